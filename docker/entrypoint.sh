#!/bin/sh
# Entry point of the image: `tidal ARGS...` (`tidal serve --host 0.0.0.0 --port 8000` by default).
# A checkpoint mounted at /model becomes the model: `tidal run` reads it from TIDAL_MODEL (unless that
# is set already or --model is given), and `tidal serve` gets --model /model (a later --model wins).
# Without one, both serve the built-in demo checkpoint.
set -e
if [ -f /model/config.json ]; then
    export TIDAL_MODEL="${TIDAL_MODEL:-/model}"
    if [ "$1" = serve ]; then
        shift
        set -- serve --model "$TIDAL_MODEL" "$@"
    fi
fi
exec tidal "$@"
