import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trainer.config import parse_config
from trainer.rewards import (
    RemoteReward,
    RewardError,
    build_reward,
    exact_match,
    extract_number,
    format_reward,
)


def _reward(**reward):
    return build_reward(parse_config({"reward": reward}))


def test_exact_match_reads_the_first_number_of_the_response():
    prompts = ["12+35="] * 6
    responses = ["47", "47 and more", " 47\n", "48", "", "abc"]
    answers = ["47"] * 6
    assert exact_match(prompts, responses, answers) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    # the first number counts, not a later right one
    assert exact_match(["x"], ["4 then 47"], ["47"]) == [0.0]


def test_exact_match_number_forms_and_markers():
    assert extract_number("so 1,234 apples") == extract_number("1234")
    assert extract_number("step 3 ... #### 72") == 72
    assert extract_number("\\boxed{-5}") == -5
    assert extract_number("no digits") is None
    assert exact_match(["q"] * 3, ["3.0", "-7", "3.5"], ["3", "-7", "#### 3.5"]) == [1.0, 1.0, 1.0]
    assert exact_match(["q"], ["Paris"], ["Paris"]) == [1.0]  # non-numeric answers: text equality


def test_exact_match_without_answers_is_an_error():
    with pytest.raises(RewardError, match="reference answers"):
        exact_match(["q"], ["1"], [None])


def test_format_and_combined_rules():
    responses = ["47", " 12 ", "47!", "x"]
    assert format_reward(["q"] * 4, responses, [None] * 4) == [1.0, 1.0, 0.0, 0.0]
    combined = _reward(kind="rule", rule="exact_match+format")
    assert combined(["q"] * 4, responses, ["47"] * 4) == pytest.approx([1.1, 0.1, 1.0, 0.0])
    assert _reward(kind="rule", rule="exact_match")(["q"], ["47"], ["47"]) == [1.0]


def length_reward(prompts, responses, answers):
    return [float(len(r)) for r in responses]


def wrong_length_reward(prompts, responses, answers):
    return [1.0]


def crashing_reward(prompts, responses, answers):
    raise KeyError("boom")


def test_user_function_by_module_path():
    fn = _reward(kind="function", function="tests.unit.test_rewards:length_reward")
    assert fn(["a", "b"], ["xy", "xyz"], [None, None]) == [2.0, 3.0]
    with pytest.raises(RewardError, match="returned 1 scores for 2"):
        _reward(kind="function", function="tests.unit.test_rewards:wrong_length_reward")(
            ["a", "b"], ["x", "y"], [None, None])
    with pytest.raises(RewardError, match="raised KeyError"):
        _reward(kind="function", function="tests.unit.test_rewards:crashing_reward")(
            ["a"], ["x"], [None])
    with pytest.raises(RewardError, match="has no 'missing'"):
        _reward(kind="function", function="tests.unit.test_rewards:missing")
    with pytest.raises(RewardError, match="cannot import"):
        _reward(kind="function", function="no_such_module_xyz:f")


class _Scorer:
    """A real HTTP scorer on a local port; fails the first ``fail_first`` requests with 503."""

    def __init__(self, fail_first=0, delay_s=0.0, status=503):
        self.requests: list[dict] = []
        scorer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                scorer.requests.append(body)
                time.sleep(delay_s)
                if len(scorer.requests) <= fail_first:
                    self.send_response(status)
                    self.end_headers()
                    self.wfile.write(b"down")
                    return
                rewards = [float(r == a) for r, a in zip(body["responses"], body["answers"], strict=True)]
                data = json.dumps({"rewards": rewards}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def scorer_factory():
    made = []

    def make(**kw):
        made.append(_Scorer(**kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_remote_scorer_batches_requests(scorer_factory):
    scorer = scorer_factory()
    fn = _reward(kind="remote", url=scorer.url, batch_size=2)
    answers = ["1", "2", "3", "4", "5"]
    assert fn(["p"] * 5, ["1", "x", "3", "4", "y"], answers) == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert [len(r["prompts"]) for r in scorer.requests] == [2, 2, 1]


def test_remote_scorer_retries_then_succeeds(scorer_factory):
    scorer = scorer_factory(fail_first=2)
    fn = RemoteReward(scorer.url, retries=2, backoff_s=0.01)
    assert fn(["p"], ["a"], ["a"]) == [1.0]
    assert len(scorer.requests) == 3


def test_remote_scorer_final_failure_is_a_reward_error(scorer_factory):
    scorer = scorer_factory(fail_first=100)
    fn = RemoteReward(scorer.url, retries=1, backoff_s=0.01)
    with pytest.raises(RewardError, match="failed after 2 attempts: HTTP 503"):
        fn(["p"], ["a"], ["a"])
    refusing = scorer_factory(fail_first=100, status=400)
    with pytest.raises(RewardError, match="refused the batch: HTTP 400"):
        RemoteReward(refusing.url, retries=3, backoff_s=0.01)(["p"], ["a"], ["a"])
    assert len(refusing.requests) == 1  # a 4xx is not retried


def test_remote_scorer_timeout_and_unreachable(scorer_factory):
    slow = scorer_factory(delay_s=1.0)
    with pytest.raises(RewardError, match="ReadTimeout"):
        RemoteReward(slow.url, timeout_s=0.2, retries=1, backoff_s=0.01)(["p"], ["a"], ["a"])
    with pytest.raises(RewardError, match="ConnectError"):
        RemoteReward("http://127.0.0.1:9/score", retries=0)(["p"], ["a"], ["a"])


def test_reward_model_scores_match_unbatched_forward(tmp_path):
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    from trainer.models import make_tiny_model

    lm_dir = make_tiny_model(tmp_path / "lm", "nano", ["1+2=3", "hello world"])
    config = Qwen2Config.from_pretrained(lm_dir, num_labels=1)
    torch.manual_seed(0)
    rm = Qwen2ForSequenceClassification(config)
    rm.save_pretrained(tmp_path / "rm")
    AutoTokenizer.from_pretrained(lm_dir).save_pretrained(tmp_path / "rm")

    fn = _reward(kind="model", model_path=str(tmp_path / "rm"), batch_size=2)
    prompts, responses = ["1+2=", "12+30=", "hello"], ["3", "42 is it", " world"]
    scores = fn(prompts, responses, [None] * 3)
    tok = AutoTokenizer.from_pretrained(tmp_path / "rm")
    with torch.no_grad():
        expected = [rm(**tok(p + r, return_tensors="pt")).logits[0, 0].item()
                    for p, r in zip(prompts, responses, strict=True)]
    assert scores == pytest.approx(expected, abs=1e-4)
    assert len(set(round(s, 6) for s in scores)) == 3
