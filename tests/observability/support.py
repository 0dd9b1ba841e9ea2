"""Drive a sampler through steps the way a trainer does: GET /batch N, POST /weights_version N+1.

`token`: the sampler's run token (`api_token`), sent as a bearer token when given."""

from __future__ import annotations

from typing import Any

import httpx

from shared.token_guard import bearer_headers


def take_batch(url: str, step: int, token: str | None = None) -> dict[str, Any]:
    response = httpx.get(f"{url}/batch", params={"step": step, "timeout": 30}, timeout=40,
                         headers=bearer_headers(token))
    assert response.status_code == 200, (step, response.status_code, response.text[:300])
    return response.json()


def publish(url: str, version: int, checkpoint_path: str | None = None,
            metrics: dict[str, float | None] | None = None, token: str | None = None) -> None:
    """POST /weights_version N, with the trainer's `metrics` for the step that made it if given."""
    body: dict[str, Any] = {"version": version, "checkpoint_path": checkpoint_path}
    if metrics is not None:
        body["metrics"] = metrics
    response = httpx.post(f"{url}/weights_version", json=body, timeout=30, headers=bearer_headers(token))
    assert response.status_code == 200, response.text


def train_steps(url: str, steps: range) -> list[dict[str, Any]]:
    """Take each batch and publish the next version, as a trainer finishing each step."""
    batches = []
    for step in steps:
        batches.append(take_batch(url, step))
        publish(url, step + 1)
    return batches


def run_eval(url: str, num_examples: int = 4, token: str | None = None) -> dict[str, Any]:
    started = httpx.post(f"{url}/eval", json={"num_examples": num_examples}, timeout=10,
                         headers=bearer_headers(token))
    assert started.status_code == 202, started.text
    eval_id = started.json()["eval_id"]
    done = httpx.get(f"{url}/eval/{eval_id}", params={"timeout": 30}, timeout=40,
                     headers=bearer_headers(token)).json()
    assert done["status"] == "done", done
    return done
