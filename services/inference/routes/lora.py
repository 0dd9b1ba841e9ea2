"""LoRA adapters loaded at runtime, vLLM's endpoints and answers (vllm/entrypoints/serve/lora,
models/serving.py in vLLM 0.32); the loading itself is adapters.py's.

* `POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace": false}` -> 200, the text
  `Success: LoRA adapter '<name>' added successfully.`; 400 when a name or path is empty, the name
  is the base model's, or it is loaded already and load_inplace is false; 404 when lora_path holds
  no adapter; 400 when the adapter does not fit the model or the server's limits.
* `POST /v1/unload_lora_adapter {"lora_name"}` -> 200, `Success: LoRA adapter '<name>' removed
  successfully.`; 404 for a name not loaded.

Without --enable-lora both are a 404 that names the flag (vLLM: the routes do not exist).
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from services.inference import protocol as P
from services.inference.adapters import DISABLED, Adapters
from services.inference.deps import EngineDep, Served
from services.inference.engine import Engine
from services.inference.request_error import RequestError

router = APIRouter(tags=["lora"])


def _adapters(eng: Engine) -> Adapters:
    if eng.adapters is None:
        raise RequestError(DISABLED, status=404)
    return eng.adapters


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(req: P.LoadLoraAdapterRequest, eng: EngineDep, served: Served):
    adapters = _adapters(eng)
    if not req.lora_name or not req.lora_path:
        raise RequestError("Both 'lora_name' and 'lora_path' must be provided.")
    if req.lora_name == served.id:
        raise RequestError(f"The lora adapter '{req.lora_name}' conflicts with a served base model.",
                           param="lora_name")
    await adapters.load(req.lora_name, req.lora_path, req.load_inplace)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(req: P.UnloadLoraAdapterRequest, eng: EngineDep):
    await _adapters(eng).unload(req.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
