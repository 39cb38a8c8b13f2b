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


def hub_snapshot(repo: str, revision: str | None) -> str:
    """The local directory of Hugging Face repository ``repo`` at ``revision``: from the hub cache
    (``HF_HUB_CACHE``), downloaded first unless ``HF_HUB_OFFLINE`` is set. An ``ArgsError`` in one line when the
    repository, revision or a file cannot be had."""
    from ..config.server_args import ArgsError

    try:
        from huggingface_hub import errors, snapshot_download
    except ImportError:
        raise ArgsError(f"--model {repo}: not a directory, and huggingface_hub is not installed to fetch it") from None
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    where = f"--model {repo}" + (f" --revision {revision}" if revision else "")
    try:
        # The environment as it is now (huggingface_hub reads it once, at import).
        return snapshot_download(repo, revision=revision, local_files_only=offline,
                                 cache_dir=os.environ.get("HF_HUB_CACHE") or None,
                                 allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.tiktoken", "*.txt"])
    except errors.HFValidationError:
        raise ArgsError(f"--model {repo}: not a directory, nor a Hugging Face repository id (owner/name)") from None
    except errors.RepositoryNotFoundError:
        raise ArgsError(f"{where}: no such repository on the Hugging Face Hub (or it needs a token: HF_TOKEN)") \
            from None
    except errors.RevisionNotFoundError:
        raise ArgsError(f"{where}: no such revision") from None
    except errors.LocalEntryNotFoundError:
        state = "HF_HUB_OFFLINE is set" if offline else "the Hub cannot be reached"
        raise ArgsError(f"{where}: not in the Hugging Face cache ({os.environ.get('HF_HUB_CACHE') or 'the default'}) "
                        f"and {state}") from None
    except (errors.EntryNotFoundError, errors.HfHubHTTPError, OSError) as e:
        raise ArgsError(f"{where}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'download failed'}") \
            from None


def checkpoint_path(model: str | None, revision: str | None = None) -> str:
    """The checkpoint a mesh serves: ``--model``, a directory holding a readable Qwen4-Exp config or a Hugging Face
    repository id (``--revision``), or the demo checkpoint. An ``ArgsError`` names ``--model`` and what is wrong."""
    from ..config.model import ConfigError, ModelConfig
    from ..config.server_args import ArgsError

    if model is None:
        return demo_checkpoint()
    if not os.path.isdir(model):
        if os.path.exists(model) or model.startswith((".", "/", "~")) or model.count("/") != 1:
            raise ArgsError(f"--model {model}: not a directory")
        model = hub_snapshot(model, revision)
    try:
        ModelConfig.from_file(model)
    except ConfigError as e:
        raise ArgsError(f"--model {model}: {e}") from None
    return model
