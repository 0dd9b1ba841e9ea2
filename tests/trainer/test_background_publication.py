"""Publication off the trainer's critical path (services/trainer/publication.py), against the
real sampler and the real CPU inference server: versions are written, probed and POSTed while
the next step trains; full versions every `full_every`, deltas between them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from services.trainer import checkpoint as ckpt
from services.trainer.trainer import train
from shared import weights_delta
from shared.client import BatchNotReady
from tests.trainer.test_integration import TOKEN, RecordingClient, _records, _settings


class SlowPublishClient(RecordingClient):
    """The real client, whose POST /weights_version takes `delay` seconds longer; remembers when
    each POST ended and when each batch arrived."""

    def __init__(self, *args, delay: float = 0.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.delay = delay
        self.posted_at: dict[int, float] = {}
        self.batch_at: dict[int, float] = {}
        self.not_ready: list[int] = []  # steps the sampler answered 409 for (asked too early)

    async def publish_weights(self, version: int, *args, **kwargs):
        await asyncio.sleep(self.delay)
        try:
            return await super().publish_weights(version, *args, **kwargs)
        finally:
            self.posted_at[version] = time.monotonic()

    async def get_batch(self, step: int, *args, **kwargs):
        try:
            batch = await super().get_batch(step, *args, **kwargs)
        except BatchNotReady:
            self.not_ready.append(step)
            raise
        self.batch_at.setdefault(step, time.monotonic())
        return batch


@pytest.mark.timeout(180)
async def test_the_next_step_trains_while_a_version_publishes(stack, tiny_model_dir: Path, tmp_path: Path) -> None:
    sampler, _ = stack  # max_staleness 1: batch N may come from version N-1
    run_dir = tmp_path / "trainer"
    async with SlowPublishClient(sampler.url, api_token=TOKEN, delay=1.5) as client:
        summary = await train(_settings(tiny_model_dir, sampler, run_dir, max_steps=4, eval_at_start=False,
                                        eval_at_end=False), client)
        served = await client.weights_version()
    assert summary["final_version"] == 4 and served.version == 4
    assert all(server.probe.ok for server in served.servers)
    # Batch N (which training step N starts with) arrived while version N was still being
    # announced: the trainer did not wait for the POST.
    for version in (1, 2, 3):
        assert client.batch_at[version] < client.posted_at[version], (version, client.batch_at, client.posted_at)
    steps = _records(run_dir, "step")
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    for r in steps:
        assert r["snapshot_s"] >= 0 and r["publish_s"] >= 1.5 and r["published_bytes"] > 0, r
        assert r["publish_kind"] in ("full", "delta") and "write_s" in r and "probe_s" in r, r
    # A step is much shorter than the 1.5 s POST: the next snapshot waited for it, and said so.
    assert all(r["publish_wait_s"] > 0.5 for r in steps[1:]), [r["publish_wait_s"] for r in steps]
    # The prefetch of batch N+1 waited for version N's POST instead of asking while it was in
    # flight: the sampler never had to answer 409 (each one costs a retry after a back-off sleep).
    assert client.not_ready == []


@pytest.mark.timeout(180)
async def test_at_max_staleness_0_the_trainer_waits_for_each_version_and_says_so(make_stack, tiny_model_dir: Path,
                                                                             tmp_path: Path) -> None:
    sampler, _ = make_stack(max_staleness=0)  # batch N+1 needs version N+1: nothing to overlap
    run_dir = tmp_path / "trainer"
    async with SlowPublishClient(sampler.url, api_token=TOKEN, delay=1.0) as client:
        await train(_settings(tiny_model_dir, sampler, run_dir, max_steps=3, eval_at_start=False, eval_at_end=False),
                    client)
    for version in (1, 2):  # batch N was asked for only once version N was out
        assert client.posted_at[version] < client.batch_at[version], (version, client.posted_at, client.batch_at)
    steps = _records(run_dir, "step")
    # The whole publication (the 1 s POST included) is on the critical path, and the record says so.
    assert all(r["publish_wait_s"] >= r["publish_s"] >= 1.0 for r in steps), [r["publish_wait_s"] for r in steps]


@pytest.mark.timeout(180)
async def test_deltas_between_full_versions_rebuild_the_trainers_weights(stack, tiny_model_dir: Path,
                                                                       tmp_path: Path) -> None:
    sampler, _ = stack
    run_dir = tmp_path / "trainer"
    async with RecordingClient(sampler.url, api_token=TOKEN) as client:
        await train(_settings(tiny_model_dir, sampler, run_dir, max_steps=6, eval_at_start=False, eval_at_end=False,
                              learning_rate=1e-6, publish_dtype="bfloat16", full_every=3, keep_published=2,
                              checkpoint_every=6), client)
        served = await client.weights_version()
    assert served.version == 6 and all(server.probe.ok for server in served.servers), served
    steps = _records(run_dir, "step")
    assert [r["publish_kind"] for r in steps] == ["full", "delta", "delta", "full", "delta", "delta"]
    full_bytes = steps[0]["published_bytes"]
    for r in steps:
        if r["publish_kind"] == "delta":
            assert r["published_bytes"] < 0.2 * full_bytes and 0 < r["delta_fraction"] < 0.05, r
    # keep_published 2 keeps versions 5 and 6, and the full version 4 they are built on.
    root = run_dir / "published"
    assert [v for v, _ in ckpt.list_published(root)] == [4, 5, 6]
    manifest = weights_delta.read_manifest(root / "version-6")
    assert (manifest["kind"], manifest["base_version"], manifest["full_version"]) == ("delta", 5, 4)

    # The chain rebuilds exactly the trainer's weights after step 5 (its checkpoint), in bf16.
    from safetensors.torch import load_file

    tensors, _ = weights_delta.load_state(root / "version-6")
    trained = load_file(str(ckpt.step_path(run_dir, 5) / "model.safetensors"))
    assert tensors.keys() <= trained.keys()
    for name, value in tensors.items():
        assert torch.equal(value, trained[name].to(torch.bfloat16)), name


@pytest.mark.timeout(60)
async def test_one_publication_in_flight_and_its_error_surfaces_at_the_next_wait() -> None:
    from services.trainer.publication import Job, Publisher, Writer

    def full(version: int, step: int, tensors: dict) -> Path:
        raise ValueError(f"refusing to publish version {version}: non-finite values in ['w']")

    async def post(*args, **kwargs) -> None:
        raise AssertionError("nothing may be announced after a failed write")

    publisher = Publisher(Writer(full=full), post=post, done=lambda job: None, prune=lambda path: None)
    publisher.start(Job(1, 0, {"w": torch.zeros(2)}, {}))
    with pytest.raises(RuntimeError, match="still in flight"):
        publisher.start(Job(2, 1, {"w": torch.zeros(2)}, {}))
    with pytest.raises(ValueError, match="non-finite"):
        await publisher.wait()
    assert await publisher.wait() == 0.0  # nothing in flight any more
    await publisher.close()


@pytest.mark.timeout(60)
async def test_posted_waits_only_for_the_version_in_flight() -> None:
    from services.trainer.publication import Job, Published, Publisher, Writer

    answer = asyncio.Event()
    posts: list[int] = []

    async def post(version: int, *args, **kwargs) -> None:
        await answer.wait()
        posts.append(version)

    publisher = Publisher(Writer(full=lambda version, step, tensors: Path(f"/v{version}")), post=post,
                          done=lambda job: None, prune=lambda path: None)
    await asyncio.wait_for(publisher.posted(3), 1)  # nothing in flight
    # Jobs without tensors announce the newest version again: no disk needed.
    publisher.chain.last = Published(2, Path("/v2"), {}, None, {"token_ids": [1]})
    publisher.start(Job(3, 2, None, None))
    await asyncio.wait_for(publisher.posted(2), 1)  # posted before version 3 started
    await asyncio.wait_for(publisher.posted(4), 1)  # not this publisher's yet
    waiting = asyncio.create_task(publisher.posted(3))
    await asyncio.sleep(0.2)
    assert not waiting.done()  # version 3's POST has not answered
    answer.set()
    await asyncio.wait_for(waiting, 1)
    assert posts == [3]
    await publisher.wait()

    async def refuse(*args, **kwargs) -> None:
        raise RuntimeError("the sampler refused version 4")

    # A publication that fails releases its waiters too; its error surfaces at wait().
    publisher.post = refuse
    publisher.start(Job(4, 3, None, None))
    await asyncio.wait_for(publisher.posted(4), 1)
    with pytest.raises(RuntimeError, match="refused version 4"):
        await publisher.wait()
    await publisher.close()


def test_after_a_refused_delta_versions_are_written_whole_for_full_every_versions(monkeypatch) -> None:
    from services.trainer.publication import Chain, Writer
    from shared import weights_delta as wd

    moved = {2: 0.9, 3: 0.1, 4: 0.1, 5: 0.1, 6: 0.1}  # the share of values each version changes
    tries: list[int] = []

    def delta(version: int, step: int, tensors: dict, base) -> tuple[Path, dict]:
        tries.append(version)
        if moved[version] > 0.5:
            raise wd.DeltaError(f"{moved[version]:.0%} of the values changed: write version {version} in full")
        return Path(f"version-{version}"), {"kind": "delta"}

    monkeypatch.setattr(wd, "read_manifest", lambda path: {"kind": "full"})  # no files are written
    writer = Writer(full=lambda version, step, tensors: Path(f"version-{version}"), delta=delta)
    chain = Chain(full_every=3)
    kinds = [chain.write(writer, version, version - 1, {}).manifest["kind"] for version in range(1, 7)]
    # Version 2's delta is refused: 3 and 4 are written whole without a try (each try diffs
    # every tensor); version 5 tries again.
    assert tries == [2, 5, 6]
    assert kinds == ["full", "full", "full", "full", "delta", "delta"]


@pytest.mark.parametrize("value, says", [("0", "greater than or equal to 1"), ("1001", "less than or equal to 1000")])
def test_a_full_every_out_of_range_is_refused_naming_the_flag(value: str, says: str, tmp_path: Path) -> None:
    from services.trainer.config import TrainerSettings
    from shared.settings import SettingsError, build

    with pytest.raises(SettingsError) as info:
        build(TrainerSettings, {"model": str(tmp_path), "sampler_url": "http://127.0.0.1:9", "full_every": value})
    assert "--full-every" in str(info.value) and says in str(info.value)
