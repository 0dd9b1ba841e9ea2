"""POST /eval and GET /eval/{id}: jobs run on the served weights and report rewards."""

from __future__ import annotations

import httpx

from tests.reliability.support import wait_for


def test_eval_runs_and_reports_rewards(make_sampler):
    sampler = make_sampler()
    with httpx.Client(base_url=sampler.url, timeout=60) as http:
        accepted = http.post("/eval", json={"num_examples": 5})
        assert accepted.status_code == 202
        eval_id = accepted.json()["eval_id"]
        result = http.get(f"/eval/{eval_id}", params={"timeout": 30}).json()
        assert result["status"] == "done", result
        r = result["result"]
        assert r["num_examples"] == 5
        assert r["env"] == "count"
        assert set(r["rewards_mean"]) == {"digit", "length"}
        # Greedy stand-in output is "01234567": it has digits and full length.
        assert r["reward_mean"] == 1.5
        assert r["policy_version"] == 0


def test_unknown_eval_is_404_and_bad_requests_are_422(make_sampler):
    sampler = make_sampler()
    with httpx.Client(base_url=sampler.url, timeout=30) as http:
        assert http.get("/eval/nope").status_code == 404
        assert http.post("/eval", json={"num_examples": 0}).status_code == 422
        assert http.post("/eval", json={"temperature": -1}).status_code == 422
        bad_env = http.post("/eval", json={"env": "no.such.module:Env"})
        assert bad_env.status_code == 422
        assert "no.such.module" in bad_env.json()["detail"]


def test_pending_eval_long_poll_returns_current_status(make_sampler, standin):
    httpx.post(standin.url + "/pause")
    sampler = make_sampler()
    try:
        with httpx.Client(base_url=sampler.url, timeout=30) as http:
            eval_id = http.post("/eval", json={"num_examples": 2}).json()["eval_id"]
            waiting = http.get(f"/eval/{eval_id}", params={"timeout": 0.3}).json()
            assert waiting["status"] in ("pending", "running")
            httpx.post(standin.url + "/resume")
            assert http.get(f"/eval/{eval_id}", params={"timeout": 30}).json()["status"] == "done"
    finally:
        httpx.post(standin.url + "/resume")


def test_a_single_turn_eval_sends_its_prompts_as_lists_of_eval_concurrency(make_sampler, standin):
    """5 prompts at eval_concurrency 2: three requests (2 + 2 + 1 prompts), not five, with the
    rewards one request per prompt gave (tests/support/envs.CountEnv: 1.5 for greedy "01234567")."""
    sampler = make_sampler(eval_concurrency=2)
    stats = standin.url + "/_standin/stats"
    with httpx.Client(base_url=sampler.url, timeout=60) as http:
        # Batches 0 and 1 (max_staleness 1 on version 0) are all the producer builds: sealed,
        # it sends nothing more until a version is published.
        assert http.get("/batch", params={"step": 1, "timeout": 30}).status_code == 200
        wait_for(lambda: http.get("/status").json()["queues"]["batches_in_progress"] == 0, 10, "the producer idle")
        before = httpx.get(stats).json()["requests"]
        eval_id = http.post("/eval", json={"num_examples": 5}).json()["eval_id"]
        result = http.get(f"/eval/{eval_id}", params={"timeout": 30}).json()
        assert result["status"] == "done", result
        assert httpx.get(stats).json()["requests"] - before == 3
        r = result["result"]
        assert r["num_examples"] == 5 and r["reward_mean"] == 1.5
        assert [e["completion"] for e in r["examples"]] == ["01234567"] * 5
        assert len({e["prompt_id"] for e in r["examples"]}) == 5
