"""Weight updates, as a sampler drives them: pause, reload, relabel, resume.

* `POST /pause?mode=abort|wait|keep` (default abort, as vLLM) -> `{"status": "paused"}`;
  `POST /resume` -> `{"status": "resumed"}`; `GET /is_paused` -> `{"is_paused": bool}`.
* `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": dir}}` ->
  `{"results": [null]}` (one entry per worker; the CPU server has one). The same with
  `"method": "tandem_reload_weights"` -> `{"results": [{"weights_path", "seconds", "repacked": [],
  "reprocessed": 0, "applied", "delta"}]}`, the answer of Tandem's vLLM worker extension
  (vllm_ext.py), so a sampler may call that name on every Tandem server; `applied` says how
  the weights came in: "delta" (a delta version applied in place, `delta` true), "full" or
  "chain" (a delta version's chain replayed: the server did not hold its base). Other
  methods: 400. `tandem_reload_weights` also takes `"weight_version": str`: the label then
  changes with the weights between two engine steps, so a sampler needs no pause, relabel or
  resume around the reload (one round trip instead of four; the answer echoes `weight_version`).
  And `"probe_token_ids": [int, ...]` (at least two): the answer's `probe` holds their prompt
  logprobs under the new weights in a completion's shape (`{"choices": [{"prompt_logprobs":
  [null, {"<id>": {"logprob", "rank", "decoded_token"}}, ...]}]}`), computed before any step
  runs on them, so the sampler verifies the version without a probe request of its own.
* `GET /server_info` -> `{"tandem": {"server": "cpu", "reload_method": "tandem_reload_weights",
  "relabels_on_reload": true}}`: how a sampler learns that (vLLM answers it with its
  configuration, in dev mode).
* `POST /update_weight_version {"new_version": str}` -> `{"success": true, "new_version": str}`;
  `GET /weight_info` -> `{"weight_version": str}`.
* `POST /reset_prefix_cache` -> `{"success": true}` (the CPU engine keeps no prefix cache).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Query

from services.inference import protocol as P
from services.inference.deps import EngineDep
from services.inference.request_error import RequestError
from services.inference.routes.common import token_pieces
from services.inference.vllm_ext import RELABELS, RELOAD_METHOD

router = APIRouter(tags=["weights"])


@router.post("/pause")
async def pause(eng: EngineDep, mode: str = Query("abort"),
                wait_for_inflight_requests: bool = Query(False), clear_cache: bool = Query(True)):
    # clear_cache is accepted for vLLM compatibility; there is no prefix cache to clear.
    if wait_for_inflight_requests:
        mode = "wait"
    await eng.pause(mode)  # type: ignore[arg-type]
    return {"status": "paused"}


@router.post("/resume")
async def resume(eng: EngineDep):
    await eng.resume()
    return {"status": "resumed"}


@router.get("/is_paused")
async def is_paused(eng: EngineDep):
    return {"is_paused": eng.is_paused}


@router.post("/collective_rpc")
async def collective_rpc(req: P.CollectiveRpcRequest, eng: EngineDep):
    if req.method not in ("reload_weights", RELOAD_METHOD):
        raise RequestError(
            f"collective_rpc method {req.method!r} is not supported by the CPU inference server; "
            f"supported: reload_weights, {RELOAD_METHOD}", param="method",
        )
    path = req.kwargs.get("weights_path")
    if path is not None and not isinstance(path, str):
        raise RequestError("kwargs.weights_path must be a string path", param="weights_path")
    label = req.kwargs.get("weight_version")
    if label is not None and (req.method != RELOAD_METHOD or not isinstance(label, str)):
        raise RequestError(f"kwargs.weight_version must be a string, and only {RELOAD_METHOD} takes it "
                           "(reload_weights leaves the label to POST /update_weight_version)", param="weight_version")
    probe_ids = req.kwargs.get("probe_token_ids")
    if probe_ids is not None and (req.method != RELOAD_METHOD or not isinstance(probe_ids, list)
                                  or not 2 <= len(probe_ids) <= eng.max_model_len
                                  or not all(type(t) is int and 0 <= t < eng.vocab_size for t in probe_ids)):
        raise RequestError(f"kwargs.probe_token_ids must be a list of 2 to {eng.max_model_len} token ids below "
                           f"{eng.vocab_size}, and only {RELOAD_METHOD} takes it", param="probe_token_ids")
    started = time.perf_counter()
    loaded = await eng.reload_weights(path, weight_version=label, probe_ids=probe_ids)
    if req.method == "reload_weights":
        return {"results": [None]}
    answer = {"weights_path": str(path or eng.model_path), "seconds": round(time.perf_counter() - started, 4),
              # The CPU engine multiplies by its parameters directly: there is nothing to repack.
              "repacked": [], "reprocessed": 0, "applied": loaded["applied"], "delta": loaded["delta"]}
    if label is not None:
        answer["weight_version"] = label
    if probe_ids is not None:
        rows = P.prompt_logprobs_rows(loaded["prompt_logprobs"], token_pieces(eng.tokenizer, eng.pieces))
        answer["probe"] = {"choices": [{"prompt_logprobs": rows}]}
    return {"results": [answer]}


@router.get("/server_info")
async def server_info():
    return {"tandem": {"server": "cpu", **RELABELS}}


@router.post("/update_weight_version")
async def update_weight_version(req: P.UpdateWeightVersionRequest, eng: EngineDep):
    eng.set_weight_version(req.new_version)
    return {"success": True, "new_version": req.new_version}


@router.get("/weight_info")
async def weight_info(eng: EngineDep):
    return {"weight_version": eng.weight_version}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(reset_running_requests: bool = Query(False), reset_external: bool = Query(False)):
    # Both flags are accepted for vLLM compatibility; there is no prefix cache to reset.
    return {"success": True}
