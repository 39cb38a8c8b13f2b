#!/bin/sh
# Entry point of the CPU image: `tidal serve` with the container's arguments as its flags.
# Serve /model when a checkpoint is mounted there, else the built-in demo model.
set -e
if [ -f /model/config.json ]; then
    set -- --model /model "$@"
fi
exec tidal serve --host 0.0.0.0 --port 8000 "$@"
