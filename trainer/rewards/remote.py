"""A reward computed by a remote HTTP scorer.

Protocol: ``POST url`` with ``{"prompts": [...], "responses": [...], "answers": [...]}`` and the
answer ``{"rewards": [float, ...]}`` (same length). Batches of ``batch_size``; each batch is
retried ``retries`` times with exponential backoff on connection errors, timeouts and 5xx/429
answers; a 4xx answer or a malformed body fails at once. The final failure is a RewardError.
"""

from __future__ import annotations

import time

import httpx

from trainer.rewards.base import RewardError, checked

_RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}


class RemoteReward:
    """Calls a remote scorer; one ``httpx.Client`` (connection pool) per instance."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 10.0,
        retries: int = 3,
        batch_size: int = 64,
        backoff_s: float = 0.5,
        headers: dict[str, str] | None = None,
    ):
        self.url = url
        self.retries = retries
        self.batch_size = batch_size
        self.backoff_s = backoff_s
        self._client = httpx.Client(timeout=timeout_s, headers=headers)

    def _score_batch(
        self, prompts: list[str], responses: list[str], answers: list[str | None]
    ) -> list[float]:
        body = {"prompts": prompts, "responses": responses, "answers": answers}
        last = "no attempt"
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                resp = self._client.post(self.url, json=body)
            except httpx.HTTPError as exc:  # connect error, timeout, protocol error
                last = f"{type(exc).__name__}: {exc}"
                continue
            if resp.status_code in _RETRY_STATUS:
                last = f"HTTP {resp.status_code}"
                continue
            if resp.status_code >= 400:
                raise RewardError(
                    f"reward scorer {self.url} refused the batch: HTTP {resp.status_code} "
                    f"{resp.text[:200]}"
                )
            try:
                payload = resp.json()
            except ValueError as exc:
                raise RewardError(f"reward scorer {self.url} answered non-JSON") from exc
            if not isinstance(payload, dict) or "rewards" not in payload:
                raise RewardError(f"reward scorer {self.url} answered without a 'rewards' list")
            return checked(payload["rewards"], len(prompts), f"reward scorer {self.url}")
        raise RewardError(
            f"reward scorer {self.url} failed after {self.retries + 1} attempts: {last}"
        )

    def __call__(
        self, prompts: list[str], responses: list[str], answers: list[str | None]
    ) -> list[float]:
        out: list[float] = []
        for i in range(0, len(prompts), self.batch_size):
            j = i + self.batch_size
            out += self._score_batch(prompts[i:j], responses[i:j], answers[i:j])
        return out

    def close(self) -> None:
        self._client.close()
