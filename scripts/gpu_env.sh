# Source on the device machine: installs the carried wheels (.whl/) and sets PYTHONPATH so that
# `tidal` imports from this checkout. flash-linear-attention goes to its own folder, added only with
# WITH_FLA=1: transformers would pick its tf32 kernels and the float32 parity tests compare exact paths.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  $(ls .whl/*.whl | grep -v -e flash_linear -e fla_core) || return 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fla \
  .whl/flash_linear*.whl .whl/fla_core*.whl || return 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/tidal
export PYTHONPATH=/tmp/site:/tmp/pkg PYTHONUNBUFFERED=1 TIKTOKEN_CACHE_DIR=
[ "${WITH_FLA:-0}" = 1 ] && export PYTHONPATH=/tmp/fla:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
