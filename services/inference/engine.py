"""The CPU engine: continuous batched generation with pause/resume and live weight reloads.

Contract (what the HTTP layer and tests rely on):

* `await engine.generate(prompt_ids, params, n)` returns `n` `Output`s. All sequences in
  flight, from every request, are stepped together: one scheduler task admits waiting
  sequences, prefills them in one left-padded forward, and decodes every running sequence
  in one batched forward with a KV cache (`kvcache.Batch`) per step. The model runs on one
  dedicated worker thread, so the event loop (HTTP) stays responsive.
* Seeded sequences are reproducible regardless of what they are batched with (each has its
  own generator; choice i of a request with seed s uses s + i, like vLLM's parallel sampling).
* `pause(mode)` follows vLLM: "abort" ends every in-flight sequence now with finish reason
  "abort" and its partial output; "wait" stops admitting and returns once the running
  sequences finished; "keep" freezes running sequences (with their KV cache) until `resume()`.
  While paused, new requests queue and start after `resume()`.
* `reload_weights(path)` copies an HF checkpoint directory's safetensors into the live model
  between two steps (validated first: a bad checkpoint changes nothing). Keys that do not
  match, or shapes that differ, are an error. A published version is verified against its
  checksums, and a delta version is applied in place when the model holds its base
  (`weights_digest`), else loaded through its chain (weights_load.py).
* Every generated token is stamped with the weight-version label current when its step ran;
  `Output.weight_versions` holds one span per label run, over output-token indexes.
* `SamplingParams.prompt_logprobs = k` (vLLM's request field) fills `Output.prompt_logprobs`:
  for every prompt position after the first, the prompt token's log-probability under the
  weights of the step that admitted the sequence, its rank, and the top k. Computed from the
  raw logits (temperature and top-p/top-k do not apply to prompt tokens, as in vLLM) by an
  unpadded forward of the prompt, so it equals transformers' float32 log_softmax.
* With LoRA adapters (`self.adapters`, set by the server with --enable-lora: adapters.py),
  `generate(..., adapter=...)` computes a sequence with base + that adapter; rows of different
  adapters share a step. Loads run between two steps (`exclusive`), like weight reloads.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import torch

from services.inference import kvcache, weights_load
from services.inference.metrics import InferenceMetrics
from services.inference.prompt_scoring import prompt_logprobs
from services.inference.request_error import RequestError
from services.inference.sampling import RowParams, sample
from services.inference.sequences import Adapter, Adapters, Output, PromptLogprobs, SamplingParams, Sequence

log = logging.getLogger("tandem.inference.engine")

PauseMode = Literal["abort", "wait", "keep"]


class Engine:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_path: str | Path,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        weight_version: str = "0",
        seed: int = 0,
        metrics: InferenceMetrics | None = None,
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        # token id -> its text alone, for logprob answers (routes/common.token_pieces): a token's
        # text never changes, and every answer decodes the same few ids again.
        self.pieces: dict[int, str] = {}
        self.model_path = Path(model_path)
        config = model.config
        self.vocab_size = int(config.vocab_size)
        self.max_model_len = int(max_model_len or getattr(config, "max_position_embeddings", 2048))
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pad_id = next(
            (t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0
        )
        self.eos_ids = self._eos_ids(model, tokenizer)
        self.metrics = metrics or InferenceMetrics(str(model_path))
        self._version = str(weight_version)
        # The digest of the published version the model holds (None: not one with checksums).
        self.weights_digest: str | None = None
        self.metrics.on_version(None, self._version)
        self._rng = random.Random(seed)
        # One thread owns the model: steps and reloads never overlap, torch state stays put.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-engine")
        self._lock = asyncio.Lock()  # held for a whole step or reload
        self._work = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._rows: list[Sequence] = []  # row i of self._batch
        self._batch: kvcache.Batch | None = None
        self._paused = False
        self._admitting = True
        self._pause_epoch = 0
        self._task: asyncio.Task | None = None
        self.adapters: Adapters | None = None  # set by the server when it serves LoRA adapters
        self.stats = dict.fromkeys(("steps", "peak_batch_size", "last_batch_size", "generated_tokens",
                                    "prompt_tokens", "finished", "reloads", "pauses"), 0)
        self.metrics.bind(
            running=lambda: sum(1 for s in self._rows if not s.done),
            waiting=lambda: sum(1 for s in self._waiting if not s.done),
            paused=lambda: float(self._paused),
        )

    # ----------------------------------------------------------------- construction

    @classmethod
    def load(cls, model_path: str | Path, **kwargs: Any) -> Engine:
        """Load an HF model directory (blocking: call it off the event loop)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
        tokenizer = AutoTokenizer.from_pretrained(path)
        # float32: CPU bf16 matmuls are slow and would make the logprobs noisier.
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        engine = cls(model, tokenizer, model_path=path, **kwargs)
        engine._probe()
        return engine

    @staticmethod
    def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
        ids: set[int] = set()
        sources = [tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)]
        for value in sources:
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return frozenset(ids)

    def _probe(self) -> None:
        """Fail at start-up, not on the first request, when the cache layout is unsupported."""
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([[self.pad_id]]), use_cache=True)
        kvcache.check_supported(out.past_key_values)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="tandem-engine-scheduler")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._abort_all()
        self._executor.shutdown(wait=True)

    # ----------------------------------------------------------------- public API

    @property
    def weight_version(self) -> str:
        return self._version

    def set_weight_version(self, version: str) -> None:
        old, self._version = self._version, str(version)
        self.metrics.on_version(old, self._version)

    @property
    def is_paused(self) -> bool:
        return self._paused

    @property
    def num_running(self) -> int:
        return sum(1 for s in self._rows if not s.done)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise RequestError("The prompt cannot be empty.", param="prompt")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(
                f"Token id {bad[0]} is out of vocabulary (vocab size {self.vocab_size}).", param="prompt"
            )
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"request has {n} input tokens. Please reduce the length of the input.", param="prompt",
            )
        if params.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {params.max_tokens}.", param="max_tokens")
        if n + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"'max_tokens' is too large: {params.max_tokens}. This model's maximum context length is "
                f"{self.max_model_len} tokens and your request has {n} input tokens "
                f"({params.max_tokens} > {self.max_model_len} - {n}).", param="max_tokens",
            )
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_stop:
            raise RequestError(f"stop_token_ids: {bad_stop[0]} is out of vocabulary.", param="stop_token_ids")

    async def generate(self, prompt_ids: list[int], params: SamplingParams, n: int = 1,
                       adapter: Adapter | None = None) -> list[Output]:
        self.validate(prompt_ids, params)
        if adapter is not None and adapter.slot is None:  # unloaded (adapters.py) since the request named it
            raise RequestError(f"The model `{adapter.name}` does not exist.", status=404, param="model")
        loop = asyncio.get_running_loop()
        seqs = []
        for i in range(n):
            seed = params.seed + i if params.seed is not None else self._rng.getrandbits(63)
            gen = torch.Generator().manual_seed(seed % (2**63))
            seqs.append(Sequence(list(prompt_ids), params, gen, loop.create_future(), adapter=adapter))
        self._waiting.extend(seqs)
        self._work.set()
        try:
            return list(await asyncio.gather(*(s.future for s in seqs)))
        except asyncio.CancelledError:
            for s in seqs:
                s.cancelled = True
            self._work.set()
            raise

    async def pause(self, mode: PauseMode = "abort") -> None:
        if mode not in ("abort", "wait", "keep"):
            raise RequestError(f"mode must be one of abort, wait, keep; got {mode!r}", param="mode")
        self._pause_epoch += 1
        self.stats["pauses"] += 1
        epoch = self._pause_epoch
        if mode == "wait":
            self._admitting = False
            await self._idle.wait()
            if epoch != self._pause_epoch or self._admitting:
                return  # resumed (or re-paused) while draining
        async with self._lock:  # the step in progress completes first
            self._paused = True
            self._admitting = True
            if mode == "abort":
                self._abort_all()

    async def resume(self) -> None:
        self._pause_epoch += 1
        self._paused = False
        self._admitting = True
        self._work.set()

    async def reload_weights(self, weights_path: str | Path | None = None, weight_version: str | None = None,
                             probe_ids: list[int] | None = None) -> dict:
        """What was loaded and how (weights_load.Reload.as_dict: applied delta|full|chain, ...).
        With `weight_version`, the label changes with the weights between the same two steps:
        no token is labelled with a version that did not compute it, and no pause is needed.
        With `probe_ids`, their prompt logprobs under the new weights (`prompt_logprobs`, the
        base model's, as a completion would score them), before any step runs on them."""
        path = Path(weights_path) if weights_path else self.model_path
        result = await self.exclusive(self._load_weights, path, weight_version, probe_ids)
        self.stats["reloads"] += 1
        self.metrics.on_reload()
        return result

    async def exclusive(self, fn, *args: Any, before=None) -> Any:
        """`fn(*args)` on the model thread between two steps: what changes the model's weights.
        `before()` runs first on the event loop, where no step runs and no sequence is in between
        the queue and the batch; what it returns is passed to `fn` after `args`."""
        async with self._lock:
            extra = () if before is None else (before(),)
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args, *extra)

    def adapters_in_use(self) -> set[Adapter]:
        """The adapters of the sequences not yet finished (call it in `exclusive`'s `before`)."""
        return {s.adapter for s in [*self._rows, *self._waiting] if s.adapter is not None and not s.done}

    # ----------------------------------------------------------------- scheduler

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._work.wait()
            async with self._lock:
                if self._paused:
                    self._work.clear()
                    continue
                new = self._admit() if self._admitting else []
                if not new and self.num_running == 0:
                    self._work.clear()
                    self._idle.set()
                    continue
                self._idle.clear()
                label = self._version
                started = time.perf_counter()
                try:
                    finished, batch_size, prompt_tokens = await loop.run_in_executor(
                        self._executor, self._step, new, label
                    )
                except Exception as exc:  # a bug or an OOM must not kill the server
                    log.exception("engine step failed; failing the sequences in it")
                    self._fail_all(exc)
                    continue
                elapsed = time.perf_counter() - started
            self.stats["steps"] += 1
            self.stats["last_batch_size"] = batch_size
            self.stats["peak_batch_size"] = max(self.stats["peak_batch_size"], batch_size)
            self.stats["generated_tokens"] += batch_size
            self.stats["prompt_tokens"] += prompt_tokens
            self.metrics.on_step(batch_size, self.stats["peak_batch_size"], prompt_tokens, batch_size, elapsed)
            for seq in finished:
                self._resolve(seq)
            if self.num_running == 0:
                self._idle.set()
            # Let HTTP handlers run between steps even when the worker answers instantly.
            await asyncio.sleep(0)

    def _admit(self) -> list[Sequence]:
        room = self.max_num_seqs - self.num_running
        budget = self.max_num_batched_tokens
        admitted: list[Sequence] = []
        prompts: set[tuple[int, ...]] = set()
        while self._waiting and room > 0:
            seq = self._waiting[0]
            if seq.done:
                self._waiting.popleft()
                continue
            key = tuple(seq.prompt_ids)
            cost = 0 if key in prompts else len(key)
            if admitted and cost > budget:
                break
            self._waiting.popleft()
            admitted.append(seq)
            prompts.add(key)
            budget -= cost
            room -= 1
        return admitted

    def _resolve(self, seq: Sequence) -> None:
        if seq.future.done():
            return
        self.stats["finished"] += 1
        self.metrics.on_finish(seq.finish_reason or "abort")
        seq.future.set_result(seq.output(self.tokenizer))

    def _abort_all(self) -> None:
        for seq in [*self._rows, *self._waiting]:
            if not seq.done:
                seq.finish_reason = "abort"
                self._resolve(seq)
        self._waiting.clear()

    def _fail_all(self, exc: Exception) -> None:
        for seq in [*self._rows, *self._waiting]:
            if not seq.future.done():
                seq.future.set_exception(RuntimeError(f"engine step failed: {exc}"))
        self._rows, self._batch = [], None
        self._waiting.clear()

    # ----------------------------------------------------------------- worker thread

    def _step(self, new: list[Sequence], label: str) -> tuple[list[Sequence], int, int]:
        with torch.inference_mode():
            self._compact()
            parts = []
            if self._batch is not None:
                parts.append(self._decode())
            prompt_tokens = 0
            if new:
                self._fill_prompt_logprobs(new)
                batch, logits, prompt_tokens = self._prefill(new)
                self._batch = kvcache.Batch.merge(self._batch, batch)
                self._rows.extend(new)
                parts.append(logits)
            logits = torch.cat(parts) if len(parts) > 1 else parts[0]
            rows = [self._row_params(seq) for seq in self._rows]
            result = sample(logits, rows)
        assert self._batch is not None
        self._batch.pending = torch.tensor(result.tokens, dtype=torch.long)
        finished = []
        for i, seq in enumerate(self._rows):
            if seq.done:
                continue
            seq.append(result.tokens[i], result.logprobs[i], result.top[i], label, self.eos_ids, self.tokenizer)
            if seq.finish_reason is not None:
                finished.append(seq)
        return finished, len(self._rows), prompt_tokens

    def _compact(self) -> None:
        keep = [i for i, seq in enumerate(self._rows) if not seq.done]
        if len(keep) == len(self._rows):
            return
        if not keep:
            self._rows, self._batch = [], None
            return
        assert self._batch is not None
        self._batch = self._batch.select(keep)
        self._rows = [self._rows[i] for i in keep]

    def _decode(self) -> torch.Tensor:
        b = self._batch
        assert b is not None
        mask = torch.cat([b.mask, torch.ones((b.size, 1), dtype=torch.long)], dim=1)
        out = self._forward(
            [s.adapter for s in self._rows],
            input_ids=b.pending[:, None],
            attention_mask=mask,
            position_ids=b.lengths[:, None],
            past_key_values=kvcache.from_tensors(b.kv),
            use_cache=True,
        )
        self._batch = kvcache.Batch(
            kv=kvcache.to_tensors(out.past_key_values), mask=mask, lengths=b.lengths + 1, pending=b.pending
        )
        return out.logits[:, -1].float()

    def _prefill(self, seqs: list[Sequence]) -> tuple[kvcache.Batch, torch.Tensor, int]:
        # GRPO sends n copies of a prompt: prefill each distinct (prompt, adapter) once.
        unique: dict[tuple[tuple[int, ...], Adapter | None], int] = {}
        firsts: list[Sequence] = []  # one sequence per distinct (prompt, adapter): its row
        index = []
        for s in seqs:
            key = (tuple(s.prompt_ids), s.adapter)
            if key not in unique:
                unique[key] = len(firsts)
                firsts.append(s)
            index.append(unique[key])
        prompts = [s.prompt_ids for s in firsts]
        ids, mask, positions = kvcache.left_pad(prompts, self.pad_id)
        out = self._forward(
            [s.adapter for s in firsts], input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1
        )
        kv = kvcache.to_tensors(out.past_key_values)
        logits = out.logits[:, -1].float()
        if len(unique) < len(seqs):
            sel = torch.tensor(index, dtype=torch.long)
            kv = [(k.index_select(0, sel), v.index_select(0, sel)) for k, v in kv]
            mask = mask.index_select(0, sel)
            logits = logits.index_select(0, sel)
        batch = kvcache.Batch(
            kv=kv, mask=mask,
            lengths=torch.tensor([len(s.prompt_ids) for s in seqs], dtype=torch.long),
            pending=torch.zeros(len(seqs), dtype=torch.long),
        )
        return batch, logits, sum(len(p) for p in prompts)

    def _fill_prompt_logprobs(self, seqs: list[Sequence]) -> None:
        # Rare (the sampler's post-sync probe, scoring): a forward of its own per distinct
        # prompt, unpadded and with every position's logits, rather than widening the batched
        # prefill (which keeps only the last position's logits).
        done: dict[tuple[tuple[int, ...], int, Adapter | None], PromptLogprobs] = {}
        for seq in seqs:
            k = seq.params.prompt_logprobs
            if k is None:
                continue
            key = (tuple(seq.prompt_ids), k, seq.adapter)
            if key not in done:
                done[key] = self._prompt_logprobs(seq, k)
            seq.prompt_logprobs = done[key]

    def _prompt_logprobs(self, seq: Sequence, k: int) -> PromptLogprobs:
        return prompt_logprobs(lambda ids: self._forward([seq.adapter], input_ids=ids, use_cache=False).logits,
                               seq.prompt_ids, k)

    def _forward(self, adapters: list[Adapter | None], **kwargs: Any) -> Any:
        """The model's forward, each row with its adapter (None: the base model)."""
        if self.adapters is None:
            return self.model(**kwargs)
        return self.adapters.forward(adapters, **kwargs)

    def _row_params(self, seq: Sequence) -> RowParams:
        p = seq.params
        banned: tuple[int, ...] = ()
        if len(seq.token_ids) < p.min_tokens:
            banned = tuple(sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)))
        return RowParams(
            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p, generator=seq.generator,
            num_top_logprobs=p.logprobs, banned=banned,
        )

    def _load_weights(self, path: Path, label: str | None = None, probe_ids: list[int] | None = None) -> dict[str, Any]:
        try:
            result = weights_load.load(self.model, self.adapters, path, self.weights_digest)
        except weights_load.WeightsError as exc:
            raise RequestError(str(exc), param="weights_path") from None
        self.weights_digest = result.digest
        if label is not None:  # under the step lock (exclusive): the next step reads the new label
            self.set_weight_version(label)
        out = result.as_dict()
        if probe_ids:
            with torch.inference_mode():
                out["prompt_logprobs"] = prompt_logprobs(
                    lambda ids: self._forward([None], input_ids=ids, use_cache=False).logits, probe_ids, 0)
        return out
