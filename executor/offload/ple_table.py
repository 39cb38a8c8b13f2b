"""Where a PLE layer's hashed n-gram table lives (``--ple-backend gpu|pinned|disk``), behind one ``gather``.

At the default Qwen4-Exp config each PLE table holds ~41 G parameters (~82 GB in bf16) per layer, which
no GPU holds next to the rest of the model, so host residence (``pinned``) or on-demand reads from the
checkpoint (``disk``) are the normal case and device residence (``gpu``) is for small configs. A forward
only touches ``T * heads`` rows of a table, a few MB even for long prefill chunks, so gathering those
rows where the table lives and copying just them to the device costs little next to the layer's compute.

With random weights (``--load-format random``) there is no checkpoint to read: ``disk`` then computes each gathered
row from the seed (:class:`SeededTable`), so a table of any size costs neither memory nor disk.

All backends share :class:`PLETable`: ``gather(ids)`` takes long row ids ``[..., heads]`` on the
model's device and returns ``[..., heads, dim]`` rows on that device, in the table's dtype.

``disk`` maps each ``...ngram_embedding.shard_N.weight`` tensor of the checkpoint's safetensors files
read-only with ``numpy.memmap`` (the header is parsed here: safetensors' own readers copy whole tensors),
so only the pages of gathered rows are read, and the OS page cache keeps hot rows in memory for us.
"""

from __future__ import annotations

import abc
import glob
import json
import os
import struct
import threading
from concurrent.futures import Executor, Future
from dataclasses import dataclass

import numpy as np
import torch

from ...kernels.ple import gather_rows
from ...kernels.quant import E4M3_MAX
from ..weights import PLE_SHARD_KEY, canonical_name, table_rows

# safetensors dtype -> (numpy dtype the bytes are mapped as, torch dtype they are viewed as). numpy has no
# bfloat16, so 16-bit floats are mapped as int16 and reinterpreted by torch (a view, no conversion).
_ST_DTYPES: dict[str, tuple[type[np.generic], torch.dtype]] = {
    "BF16": (np.int16, torch.bfloat16),
    "F16": (np.int16, torch.float16),
    "F32": (np.float32, torch.float32),
    "F8_E4M3": (np.uint8, torch.float8_e4m3fn),  # a quantized checkpoint's table: rows times its one scale
}
# Refuse absurd header lengths (safetensors itself caps them at 100 MB) instead of reading a corrupt file whole.
_MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class ShardRef:
    """One ``...ngram_embedding.shard_N.weight`` tensor inside one .safetensors file (``rows`` of the table)."""

    file: str
    key: str
    rows: int


def read_safetensors_header(file: str) -> tuple[int, dict[str, dict]]:
    """Return ``(data_start, header)`` of a safetensors file without reading any tensor bytes.

    Layout: an 8-byte little-endian header length ``N``, ``N`` bytes of JSON mapping each key to its
    ``dtype``, ``shape`` and ``data_offsets`` (relative to ``data_start = 8 + N``). ``__metadata__`` is dropped.
    """
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{file}: too short to be a safetensors file")
        (length,) = struct.unpack("<Q", raw)
        if length > _MAX_HEADER_BYTES:
            raise ValueError(f"{file}: safetensors header length {length} is implausible")
        text = f.read(length)
    if len(text) != length:
        raise ValueError(f"{file}: truncated safetensors header")
    header = json.loads(text)
    header.pop("__metadata__", None)
    return 8 + length, header


def _checkpoint_keys(checkpoint_dir: str) -> list[tuple[str, list[str] | None]]:
    """``(file, keys)`` for the checkpoint's safetensors files; ``keys`` is None when every key of the file counts.

    With ``model.safetensors.index.json`` only the files and keys its ``weight_map`` names are used, as the
    loader does (a directory may hold stale files the index no longer refers to).
    """
    index = os.path.join(checkpoint_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f).get("weight_map", {})
        by_file: dict[str, list[str]] = {}
        for key, name in weight_map.items():
            by_file.setdefault(os.path.join(checkpoint_dir, name), []).append(key)
        return sorted(by_file.items())
    files = sorted(glob.glob(os.path.join(checkpoint_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {checkpoint_dir}")
    return [(file, None) for file in files]


def find_ple_shards(checkpoint_dir: str, table_name: str, dim: int | None = None) -> list[ShardRef]:
    """The ``shard_N`` parts of PLE table ``table_name`` in a checkpoint, sorted by ``N``.

    ``table_name`` is the module parameter name (``model.layers.1.ple.ple_embedding.ngram_embedding.weight``);
    checkpoint keys are matched after :func:`canonical_name`, so composite (``model.language_model.``) and
    text-only checkpoints both work. Raises ``ValueError`` naming the table or key when no parts exist, the
    numbering is not ``0..n-1`` (a missing or duplicated part), a part is not 2-D, or a part's column count
    differs from ``dim`` (from the first part when ``dim`` is None). The total row count is not checked here:
    compare ``sum(p.rows for p in parts)`` with the config's table rows.
    """
    found: list[tuple[int, str, str, list[int]]] = []
    for file, keys in _checkpoint_keys(checkpoint_dir):
        wanted = []
        for key in keys if keys is not None else read_safetensors_header(file)[1]:
            name = canonical_name(key)
            m = PLE_SHARD_KEY.match(name) if name is not None else None
            if m and m.group(1) + ".weight" == table_name:
                wanted.append((int(m.group(2)), key))
        if not wanted:
            continue
        _, header = read_safetensors_header(file)
        for index, key in wanted:
            if key not in header:
                raise ValueError(f"PLE shard {key} of {table_name} is listed for {file} but not stored in it")
            found.append((index, file, key, list(header[key]["shape"])))
    if not found:
        raise ValueError(f"no PLE shards of {table_name} in {checkpoint_dir}")
    found.sort(key=lambda part: part[0])
    indices = [index for index, _, _, _ in found]
    if indices != list(range(len(found))):
        raise ValueError(f"{table_name}: PLE shards {indices} are not numbered 0..{len(found) - 1}")
    expected = dim if dim is not None else (found[0][3][1] if len(found[0][3]) == 2 else None)
    parts = []
    for _, file, key, shape in found:
        if len(shape) != 2 or shape[1] != expected:
            raise ValueError(f"PLE shard {key} of {table_name} has shape {shape}, expected [rows, {expected}]")
        parts.append(ShardRef(file=file, key=key, rows=int(shape[0])))
    return parts


class _Staging:
    """A reusable pinned host buffer that gathered rows pass through on their way to a CUDA device.

    Pinned memory lets the host-to-device copy run asynchronously (``non_blocking=True``). Before the
    buffer is written again, the event recorded after the previous copy is awaited, so an in-flight copy
    never reads rows of the next gather. The buffer grows (doubling) and never shrinks.
    """

    def __init__(self, dim: int, dtype: torch.dtype):
        self.dim, self.dtype = dim, dtype
        self.buffer: torch.Tensor | None = None
        self.event: torch.cuda.Event | None = None

    def take(self, n: int) -> torch.Tensor:
        """A pinned ``[n, dim]`` host tensor that is safe to overwrite now."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        if self.buffer is None or self.buffer.shape[0] < n:
            capacity = max(n, 2 * self.buffer.shape[0] if self.buffer is not None else 0)
            self.buffer = torch.empty((capacity, self.dim), dtype=self.dtype, pin_memory=True)
        return self.buffer[:n]

    def send(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Copy ``host`` (a slice from :meth:`take`) to ``device`` asynchronously on the current stream."""
        out = host.to(device, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(device))
        return out


class PLETable(abc.ABC):
    """One PLE layer's ``[rows, dim]`` n-gram table, wherever it lives.

    Implementations are safe to call from several threads (the host-side ones hold a lock around their
    shared staging buffer), but a ``gather`` for CUDA ids blocks the calling thread while ids reach the host.
    """

    rows: int
    dim: int
    dtype: torch.dtype

    @abc.abstractmethod
    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (long ``[..., heads]`` on the model's device) as ``[..., heads, dim]`` on ``ids.device``,
        in :attr:`dtype`. Ids may repeat; out-of-range ids raise ``IndexError`` (a device assert on CUDA for
        :class:`DeviceTable`)."""

    def _out_shape(self, ids: torch.Tensor) -> tuple[int, ...]:
        return (*ids.shape, self.dim)


class DeviceTable(PLETable):
    """``--ple-backend gpu``: the table is a tensor on the model's device and ``gather`` is an index."""

    def __init__(self, table: torch.Tensor):
        if table.dim() != 2:
            raise ValueError(f"a PLE table must be 2-D [rows, dim], got shape {list(table.shape)}")
        self.table = table
        self.rows, self.dim = table.shape
        self.dtype = table.dtype

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(self.table.device, torch.long)
        return self.table.index_select(0, flat).view(self._out_shape(ids)).to(ids.device)


class PinnedTable(PLETable):
    """``--ple-backend pinned``: the table stays in host memory; only the gathered rows cross to the device.

    The table is pinned when CUDA is available (``pin_memory()`` copies it: pass a tensor allocated with
    ``pin_memory=True`` to avoid holding two copies while this runs). ``gather`` copies the ids to the host
    (a synchronisation with the ids' stream), gathers rows with ``index_select`` on the CPU into a pinned
    staging buffer, and copies them to the device with ``non_blocking=True``.
    """

    def __init__(self, table: torch.Tensor):
        if table.device.type != "cpu":
            raise ValueError(f"PinnedTable needs a CPU tensor, got one on {table.device}")
        if table.dim() != 2:
            raise ValueError(f"a PLE table must be 2-D [rows, dim], got shape {list(table.shape)}")
        table = table.contiguous()
        if torch.cuda.is_available() and not table.is_pinned():
            table = table.pin_memory()
        self.table = table
        self.rows, self.dim = table.shape
        self.dtype = table.dtype
        self._staging = _Staging(self.dim, self.dtype)
        self._ahead = _Staging(self.dim, self.dtype)  # the rows of :class:`RowsAhead`
        self._ahead_gathers: list[Future] = []  # the latest RowsAhead's gathers into ``_ahead``
        self._lock = threading.Lock()

    def gather_on_device(self, ids: torch.Tensor) -> torch.Tensor:
        """:meth:`gather` with the rows read by the device itself from the pinned table (mapped into its address
        space): one kernel, no host sync, so a decode step's CUDA graph holds it (``kernels.ple.gather_rows``).
        Rows cross PCIe one by one: for the few rows of decode steps; prompts take :meth:`gather`."""
        return gather_rows(self.table, ids)

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to("cpu", torch.long)
        if ids.device.type != "cuda":
            return torch.index_select(self.table, 0, flat).view(self._out_shape(ids)).to(ids.device)
        with self._lock:
            host = self._staging.take(flat.numel())
            torch.index_select(self.table, 0, flat, out=host)
            return self._staging.send(host, ids.device).view(self._out_shape(ids))


class RowsAhead:
    """A whole prompt's rows of one :class:`PinnedTable`, gathered ahead on worker threads and sent to the
    device chunk by chunk (or, with :meth:`upload`, in one copy on a given stream): the PLE layer of each
    internal chunk of a layer-major prefill then neither waits for its ids on the host (a
    synchronisation with the device) nor gathers.

    ``ids`` (long ``[T, heads]``) may be on the device: they are copied to pinned host memory on the
    current stream, and the workers wait for that copy, not the calling thread. Each internal chunk
    (``cuts``: its token bounds) is gathered as its own task, in chunk order, so the first chunk's rows
    are ready after an eighth of the work and several workers share the rest. On CUDA the rows land in
    the table's own pinned buffer (grown, never shrunk), which the next ``RowsAhead`` of the table
    overwrites only after this one's gathers have ended and its last copy has been made.
    """

    def __init__(self, table: PinnedTable, ids: torch.Tensor, cuts: list[int], worker: Executor):
        self.table, self.device = table, ids.device
        self.heads = ids.shape[1]
        ready = None
        if ids.device.type == "cuda":
            ids = ids.to("cpu", non_blocking=True)  # into pinned memory, ordered on the current stream
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            for gather in table._ahead_gathers:  # a forward that failed half-way may leave some running
                gather.exception()
            host = table._ahead.take(ids.numel())
        else:
            host = torch.empty((ids.numel(), table.dim), dtype=table.dtype)
        self._host = host
        self._pieces = {(lo, hi): worker.submit(self._gather, ids, host, lo, hi, ready)
                        for lo, hi in zip(cuts[:-1], cuts[1:], strict=True)}
        if self.device.type == "cuda":
            table._ahead_gathers = list(self._pieces.values())
        self._uploaded: torch.Tensor | None = None

    def _gather(self, ids: torch.Tensor, host: torch.Tensor, lo: int, hi: int,
                ready: torch.cuda.Event | None) -> torch.Tensor:
        if ready is not None:
            ready.synchronize()
        with torch.inference_mode():  # ``host`` may be an inference tensor (allocated in the forward)
            rows = host[lo * self.heads:hi * self.heads]
            torch.index_select(self.table.table, 0, ids[lo:hi].reshape(-1).long(), out=rows)
        return rows

    def upload(self, stream: torch.cuda.Stream) -> None:
        """Every chunk's rows to the device in one copy on ``stream``, once they are gathered (the calling
        thread waits for the workers); later sends take their rows from that copy."""
        for piece in self._pieces.values():
            piece.result()
        current = torch.cuda.current_stream(self.device)
        rows = torch.empty(self._host.shape, dtype=self._host.dtype, device=self.device)
        # ``rows`` may reuse memory that work queued on the current stream still reads (a tensor freed just
        # before): the copy waits for that work.
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            rows.copy_(self._host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        self.table._ahead.event = done  # the pinned buffer is not overwritten before this copy ends
        current.wait_event(done)
        self._uploaded = rows

    def send(self, lo: int, hi: int) -> torch.Tensor:
        """The rows of tokens ``lo:hi`` (one of the cuts' chunks) as ``[hi - lo, heads * dim]`` on the ids'
        device (asynchronous on CUDA)."""
        if self._uploaded is not None:
            rows = self._uploaded[lo * self.heads:hi * self.heads]
        else:
            rows = self._pieces[(lo, hi)].result()
            if self.device.type == "cuda":
                rows = self.table._ahead.send(rows, self.device)
        return rows.view(hi - lo, self.heads * self.table.dim)


class DiskTable(PLETable):
    """``--ple-backend disk``: rows read on demand from the checkpoint's safetensors files.

    Each part is a read-only ``numpy.memmap`` of its tensor's bytes, open for the object's lifetime. A
    gather deduplicates and sorts the ids (each distinct row is read once, in file order), splits them
    among the parts with a ``searchsorted`` over the parts' cumulative row starts, reads each part's rows
    with one numpy fancy index, and scatters them back into the ids' order. The parts' stored dtype may
    differ from ``dtype``: only the gathered rows are converted.
    """

    def __init__(self, parts: list[ShardRef], dim: int, dtype: torch.dtype):
        if not parts:
            raise ValueError("DiskTable needs at least one shard")
        self.dim, self.dtype = dim, dtype
        headers: dict[str, tuple[int, dict[str, dict]]] = {}
        self._maps: list[np.ndarray] = []
        stored: set[torch.dtype] = set()
        for part in parts:
            if part.file not in headers:
                headers[part.file] = read_safetensors_header(part.file)
            data_start, header = headers[part.file]
            meta = header.get(part.key)
            if meta is None:
                raise ValueError(f"tensor {part.key} is not in {part.file}")
            if meta["dtype"] not in _ST_DTYPES:
                raise ValueError(f"tensor {part.key} has dtype {meta['dtype']}; expected one of {sorted(_ST_DTYPES)}")
            np_dtype, torch_dtype = _ST_DTYPES[meta["dtype"]]
            stored.add(torch_dtype)
            if list(meta["shape"]) != [part.rows, dim]:
                raise ValueError(f"tensor {part.key} has shape {meta['shape']}, expected {[part.rows, dim]}")
            begin, end = meta["data_offsets"]
            if end - begin != part.rows * dim * np.dtype(np_dtype).itemsize:
                raise ValueError(f"tensor {part.key} has {end - begin} bytes, not {meta['shape']} of {meta['dtype']}")
            if part.rows == 0:  # mmap cannot map zero bytes
                self._maps.append(np.empty((0, dim), dtype=np_dtype))
            else:
                self._maps.append(np.memmap(part.file, dtype=np_dtype, mode="r", offset=data_start + begin,
                                            shape=(part.rows, dim)))
        if len(stored) != 1:
            raise ValueError(f"the shards {[p.key for p in parts]} mix dtypes {sorted(map(str, stored))}")
        self._stored_dtype = stored.pop()
        self._np_dtype = self._maps[0].dtype
        counts = np.array([p.rows for p in parts], dtype=np.int64)
        # starts[p] is part p's first global row; starts[-1] is the total.
        self._starts = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(counts)])
        self.rows = int(self._starts[-1])
        self._staging = _Staging(dim, dtype)
        self._lock = threading.Lock()

    def _read(self, flat: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The distinct rows of ``flat`` (sorted, in the table dtype) and each id's index among them."""
        if flat.size and (flat.min() < 0 or flat.max() >= self.rows):
            bad = flat[(flat < 0) | (flat >= self.rows)][0]
            raise IndexError(f"PLE row id {int(bad)} is out of range for a table of {self.rows} rows")
        unique, inverse = np.unique(flat, return_inverse=True)
        rows = np.empty((unique.size, self.dim), dtype=self._np_dtype)
        # bounds[p]:bounds[p + 1] is the slice of the sorted distinct ids that falls in part p.
        bounds = np.searchsorted(unique, self._starts, side="left")
        for p in np.nonzero(bounds[1:] > bounds[:-1])[0]:
            lo, hi = bounds[p], bounds[p + 1]
            # Local ids are in range by construction; mode="clip" lets numpy write straight into ``rows``
            # (mode="raise" with ``out`` goes through a temporary).
            np.take(self._maps[p], unique[lo:hi] - self._starts[p], axis=0, out=rows[lo:hi], mode="clip")
        values = torch.from_numpy(rows).view(self._stored_dtype).to(self.dtype)
        return values, torch.from_numpy(inverse.reshape(-1))

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to("cpu", torch.long).numpy()
        values, inverse = self._read(flat)
        if ids.device.type != "cuda":
            return values.index_select(0, inverse).view(self._out_shape(ids)).to(ids.device)
        with self._lock:
            host = self._staging.take(inverse.numel())
            torch.index_select(values, 0, inverse, out=host)
            return self._staging.send(host, ids.device).view(self._out_shape(ids))


class SeededTable(PLETable):
    """``--ple-backend disk`` with random weights: each gathered row computed on the ids' device from the seed
    (:func:`~tidal.executor.weights.table_rows`) and rounded through the checkpoint's dtype ``stored``, as a random
    table is filled: the values ``gpu`` and ``pinned`` hold for the same seed. ``dtype`` is the table's (``stored``,
    or FP8 with its one ``scale``)."""

    def __init__(self, name: str, rows: int, dim: int, seed: int, stored: torch.dtype, dtype: torch.dtype,
                 scale: torch.Tensor | None = None):
        if dtype == torch.float8_e4m3fn and scale is None:
            raise ValueError(f"the FP8 table {name} needs its scale")
        self.name, self.rows, self.dim, self.seed = name, rows, dim, seed
        self.stored, self.dtype, self.scale = stored, dtype, scale

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        values = table_rows(self.name, ids, self.dim, self.seed).to(self.stored)
        if self.dtype != torch.float8_e4m3fn:
            return values.to(self.dtype)
        return (values.float() / self.scale.to(ids.device)).clamp(-E4M3_MAX, E4M3_MAX).to(self.dtype)
