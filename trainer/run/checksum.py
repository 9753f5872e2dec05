"""Exact, fast checksums of tensors, for the exactness witness (trainer/run/witness.py).

Integer sums of a tensor's bytes read as 64-bit words are exact, so any changed bit changes
them, and they run at memory speed on any device with no copy to the host (a sha256 of the
same bytes runs at a tenth of that on a CPU). Two strengths, for two uses:
- `parameter_checksum`, every step: one sum per parameter of a rotating share of at most 16
  (one kernel each), enough to see a divergence by rounding, which changes bits everywhere;
- `state_digests`, every save and after every restore: every word weighted by its place in
  its block and every block by its place, so values that trade places change it too (a
  restore that put rows or shards in the wrong order).
"""

from __future__ import annotations

import hashlib
import logging

import torch

log = logging.getLogger("trainer")
BLOCK_WORDS = 4096
BLOCK_BYTES = BLOCK_WORDS * 8
CHUNK_BYTES = 32 << 20
"""Bytes of one tensor digested at a time (whole blocks): the bound on a state digest's
temporaries (on CUDA, a chunk's words times their weights, int64), whatever the largest
tensor; on a CPU the product has no temporary, and a chunk costs one more call."""
DIGEST_CHARS = 16
"""Hex characters kept of each section's sha256: 64 bits tell a wrong restore apart."""


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of the tensor's bytes (a copy only of a tensor that is not contiguous:
    a state dict's tensors are)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def as_words(raw: torch.Tensor) -> torch.Tensor:
    """Whole 64-bit words of `raw` (uint8) as int64, a copy only when it starts off a multiple
    of 8 (a slice of a larger tensor): the copy is as large as `raw`, a chunk at most."""
    return (raw.clone() if raw.storage_offset() % 8 else raw).view(torch.int64)


def tensor_checksum(tensor: torch.Tensor, weighted: bool = True, chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """A 0-dim int64 tensor on the tensor's device (sums wrap around). Unweighted: the plain
    sum of the words (bits changed). Weighted: word i of block b counts (2i+1)·(b+1) times
    (bits changed, and places traded). Read `chunk_bytes` (rounded to whole blocks) at a time:
    every temporary is a chunk's at most, and the value is the same for every chunk size
    (the blocks' sums are the same sums, taken a chunk at a time)."""
    raw = as_bytes(local_part(tensor))
    whole = raw.numel() // 8 * 8
    tail = raw[whole:].to(torch.int64).sum()
    step = max(1, chunk_bytes // BLOCK_BYTES) * BLOCK_BYTES
    if not weighted:
        for start in range(0, whole, step):
            tail = tail + as_words(raw[start:min(start + step, whole)]).sum()
        return tail
    full = whole // BLOCK_BYTES * BLOCK_BYTES
    odd = torch.arange(1, 2 * BLOCK_WORDS, 2, dtype=torch.int64, device=raw.device)
    chunks = [weighted_block_sums(as_words(raw[start:min(start + step, full)]).view(-1, BLOCK_WORDS), odd)
              for start in range(0, full, step)]
    blocks = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.int64, device=raw.device)
    words = as_words(raw[full:whole])
    places = torch.arange(1, blocks.numel() + 3, dtype=torch.int64, device=raw.device)
    rest = (words * odd[:words.numel()]).sum()
    return (blocks * places[:-2]).sum() + rest * places[-2] + tail * places[-1]


def weighted_block_sums(blocks: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
    """Each row of int64 `blocks` times `odd`, summed (wrapping). On a CPU one integer
    matrix-vector product: the same sums, 4-7 times faster than the product and the sum (no
    temporary; a save digests the whole state, bench/library_bench.py); CUDA has no int64
    product, so there the two steps, whose temporary is as large as `blocks` (one chunk)."""
    if blocks.device.type == "cpu":
        return torch.mv(blocks, odd)
    return (blocks * odd).sum(1)


def word_sum(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor_checksum(tensor, weighted=False)`, in one kernel when the tensor is whole
    64-bit words already (almost every parameter): the per-step path counts its operations."""
    tensor = local_part(tensor).detach()
    if tensor.is_contiguous() and (tensor.numel() * tensor.element_size()) % 8 == 0 and \
            (tensor.storage_offset() * tensor.element_size()) % 8 == 0:
        return tensor.view(-1).view(torch.int64).sum()
    return tensor_checksum(tensor, weighted=False)


PARAMETERS_PER_STEP = 16
"""How many parameters a step's checksum reads at most: its cost is per parameter (a kernel
and some Python), so it is bounded whatever the model; a divergence by rounding reaches every
parameter within a step, so a rotating share of them sees it."""


def parameter_checksum(parameters: list[torch.Tensor], step: int) -> int:
    """The parameters of this step's share (every k-th, from `step` mod k: the same share in
    every attempt that computes this step), each summed unweighted and weighted by its place:
    at most PARAMETERS_PER_STEP kernels, one host sync."""
    sums = parameter_sums(parameters, step)
    return placed_checksum(sums.tolist() if sums is not None else [], parameters, step)


def parameter_sums(parameters: list[torch.Tensor], step: int) -> torch.Tensor | None:
    """`parameter_checksum`'s word sums, left on the device (None: no parameters): the loop
    copies them to the host without waiting and reads them a step later (`placed_checksum`)."""
    stride = share_stride(parameters)
    sums = [word_sum(parameter) for parameter in parameters[step % stride::stride]]
    return torch.stack(sums) if sums else None


def placed_checksum(values: list[int], parameters: list[torch.Tensor], step: int) -> int:
    """The checksum of `parameter_sums(parameters, step)`'s values, each weighted by its place."""
    stride = share_stride(parameters)
    return placed(values, step % stride, stride)


def share_stride(parameters: list[torch.Tensor]) -> int:
    return -(-len(parameters) // PARAMETERS_PER_STEP) or 1


def replica_checksum(parameters: list[torch.Tensor]) -> int:
    """Every parameter's word sum, weighted by its place: whether two ranks hold the same bits
    (trainer/run/replicas.py), one kernel per parameter and one host sync."""
    return placed_word_sums(parameters, 0, 1)


def placed_word_sums(parameters: list[torch.Tensor], start: int, stride: int) -> int:
    """Every `stride`-th parameter's word sum from `start`, weighted by its place."""
    sums = [word_sum(parameter) for parameter in parameters[start::stride]]
    return placed(torch.stack(sums).tolist() if sums else [], start, stride)


def placed(values: list[int], start: int, stride: int) -> int:
    return sum((start + place * stride + 1) * value for place, value in enumerate(values)) % 2**64


def state_digests(state_dict: dict) -> dict[str, str]:
    """{top-level section: digest} of a state dict as this rank holds it: every tensor's key,
    dtype, shape and weighted checksum, and every plain value's repr, in key order."""
    entries: list[tuple[str, object]] = []
    _flatten("", state_dict, entries)
    checksums = _checksums([value for _, value in entries])
    sections: dict = {}
    for (key, value), checksum in zip(entries, checksums):
        sha = sections.setdefault(key.split(".", 1)[0], hashlib.sha256())
        described = repr(value) if checksum is None else f"{value.dtype}{tuple(value.shape)}:{checksum}"
        sha.update(f"{key}={described};".encode())
    return {name: sha.hexdigest()[:DIGEST_CHARS] for name, sha in sorted(sections.items())}


def safe_state_digests(state_dict: dict) -> dict[str, str]:
    """`state_digests`, or {} with a warning when some value cannot be read as bytes (a tensor
    subclass without storage, say): the witness must never stop a run, nor leave one rank out
    of the collective that follows."""
    try:
        return state_digests(state_dict)
    except Exception as error:  # noqa: BLE001 - any failure only means no state digest
        log.warning("exactness witness: no state digest (%s: %s); restores of this generation are not checked",
                    error.__class__.__name__, error)
        return {}


def one_process_digest(state_dict: dict) -> dict:
    """A generation's `state_digest` with one process: {"0": sections}, or {} (none computed)."""
    digest = safe_state_digests(state_dict)
    return {"0": digest} if digest else {}


def _flatten(prefix: str, value, entries: list) -> None:
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            _flatten(f"{prefix}{key}.", value[key], entries)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _flatten(f"{prefix}{index}.", item, entries)
    else:
        entries.append((prefix.rstrip("."), value))


def _checksums(values: list) -> list:
    """Each tensor's weighted checksum (None for other values), one host sync per device."""
    found: list = [None] * len(values)
    by_device: dict = {}
    for index, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            tensor = local_part(value)
            by_device.setdefault(tensor.device, []).append((index, tensor_checksum(tensor)))
    for pairs in by_device.values():
        for (index, _), checksum in zip(pairs, torch.stack([c for _, c in pairs]).tolist()):
            found[index] = checksum
    return found
