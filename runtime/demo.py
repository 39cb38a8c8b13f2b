"""The built-in demo checkpoint ``tidal serve`` runs without ``--model``: the ``small`` preset with seeded
random weights and the real tokenizer, written once under the user's cache directory."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil

from ..config.server_args import cache_dir

logger = logging.getLogger(__name__)
DEMO_PRESET = "small"
DEMO_VERSION = 2  # bumped when what `tidal checkpoint` writes changes (2: tool and reasoning template)


def demo_checkpoint() -> str:
    """The demo checkpoint's directory, written first if it is not there (one writer at a time)."""
    path = os.path.join(cache_dir(), f"demo-{DEMO_PRESET}-v{DEMO_VERSION}")
    marker = os.path.join(path, ".complete")
    if os.path.exists(marker):
        return path
    os.makedirs(cache_dir(), exist_ok=True)
    with open(os.path.join(cache_dir(), ".demo.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(marker):
            from ..executor.presets import write_checkpoint

            logger.info("writing the demo checkpoint (preset %r, random weights) to %s", DEMO_PRESET, path)
            tmp = path + ".tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            write_checkpoint(DEMO_PRESET, tmp, seed=0)
            shutil.rmtree(path, ignore_errors=True)
            os.replace(tmp, path)
            open(marker, "w").close()
    return path


def checkpoint_path(model: str | None) -> str:
    """The checkpoint a mesh serves: ``--model``, checked to be a directory holding a readable Qwen4-Exp
    config, or the demo checkpoint. An ``ArgsError`` names ``--model`` and what is wrong."""
    from ..config.model import ConfigError, ModelConfig
    from ..config.server_args import ArgsError

    if model is None:
        return demo_checkpoint()
    if not os.path.isdir(model):
        raise ArgsError(f"--model {model}: not a directory")
    try:
        ModelConfig.from_file(model)
    except ConfigError as e:
        raise ArgsError(f"--model {model}: {e}") from None
    return model
