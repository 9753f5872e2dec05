"""The light save path: a weights-only export for evaluation and serving.

`exports/step-%08d/` holds `model.safetensors` (loadable by the safetensors library alone),
`config.json` (what is needed to rebuild the model) and `manifest.json`, published with the
same atomic protocol as recovery generations.
"""

from __future__ import annotations

import shutil
import time

import torch
from torch import nn

from trainer import seams
from trainer.errors import reraise_as_storage_failure
from trainer.checkpoint.atomic import encode_json, write_file_durably
from trainer.checkpoint.manifest import Manifest
from trainer.checkpoint.section import LocalSection, Published
from trainer.layout import EXPORT_CONFIG, EXPORT_WEIGHTS, generation_name

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def full_weights(model: nn.Module, sharded: bool) -> dict[str, torch.Tensor]:
    """The whole, unsharded weights. With FSDP each rank holds only shards (DTensors), which
    safetensors cannot store: gathering them is a collective, so every rank must call this;
    with `cpu_offload` rank 0 alone receives the full tensors (in host memory, so a model
    sharded because it does not fit one device still exports) and the others get `{}`."""
    if not sharded:
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # DCP: at the first export

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def export_tensors(weights: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """CPU, contiguous copies of the weights, cast to `dtype` when one is asked for."""
    tensors = {}
    for name, tensor in weights.items():
        tensor = tensor.detach().to("cpu")
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensors[name] = tensor.contiguous().clone()
    return tensors


def write_export(section: LocalSection, weights: dict[str, torch.Tensor], step: int, epoch: int, architecture: dict,
                 dtype_name: str | None, source_digest: str, attempt_id: str) -> Published:
    started = time.monotonic()
    dtype = DTYPES[dtype_name] if dtype_name else None
    tensors = export_tensors(weights, dtype)
    stored_dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.") if tensors else None
    config = {**architecture, "dtype": stored_dtype, "step": step, "epoch": epoch, "source": source_digest}
    temporary = None
    try:
        seams.crash_point("before-export")
        temporary = section.begin(step, attempt_id)
        from safetensors.torch import save_file  # at the first export: a restart's start-up need not load it

        save_file(tensors, str(temporary / EXPORT_WEIGHTS), metadata={"step": str(step)})
        write_file_durably(temporary / EXPORT_CONFIG, encode_json(config))
        digest = section.publish(temporary, step, lambda files: Manifest.for_export(step, epoch, attempt_id, files))
    except BaseException as error:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
        reraise_as_storage_failure(error, f"writing export {generation_name(step)}")
    elapsed = time.monotonic() - started
    return Published(generation_name(step), step, digest, elapsed, elapsed)
