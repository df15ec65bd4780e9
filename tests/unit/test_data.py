import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainer.config import parse_config
from trainer.data import (
    DataError,
    Example,
    arithmetic_examples,
    load_rows,
    load_task,
    sft_target,
    task_text,
)


def _check_answers(examples: list[Example]) -> None:
    for ex in examples:
        left, op, right = ex.prompt[:-1].partition("+") if "+" in ex.prompt else (None, None, None)
        assert ex.prompt.endswith("=")
        if op:
            assert ex.answer == str(int(left) + int(right))


def test_arithmetic_answers_are_correct_and_short():
    train, evals = arithmetic_examples(digits=2, ops=["+"], train_size=500, eval_size=50, seed=0)
    assert len(train) == 500 and len(evals) == 50
    _check_answers(train + evals)
    assert all(len(ex.answer or "") <= 3 for ex in train)


def test_arithmetic_eval_is_held_out_and_deterministic():
    a_train, a_eval = arithmetic_examples(digits=2, ops=["+", "-", "*"], train_size=3000,
                                          eval_size=200, seed=7)
    b_train, b_eval = arithmetic_examples(digits=2, ops=["+", "-", "*"], train_size=3000,
                                          eval_size=200, seed=7)
    assert (a_train, a_eval) == (b_train, b_eval)
    assert not {ex.prompt for ex in a_eval} & {ex.prompt for ex in a_train}
    assert len({ex.prompt for ex in a_train}) == len(a_train)  # no duplicates either
    _, c_eval = arithmetic_examples(digits=2, ops=["+", "-", "*"], train_size=3000,
                                    eval_size=200, seed=8)
    assert c_eval != a_eval


def test_arithmetic_subtraction_and_multiplication_values():
    train, _ = arithmetic_examples(digits=1, ops=["-", "*"], train_size=10_000, eval_size=5, seed=0)
    for ex in train:
        a, b = (int(x) for x in ex.prompt[:-1].replace("*", "-").split("-"))
        value = a - b if "-" in ex.prompt else a * b
        assert ex.answer == str(value) and value >= 0
    # 1 digit: 55 canonical subtractions + 100 products exist; the train set is capped there
    assert len(train) == 55 + 100 - 5


def test_arithmetic_large_digit_counts_sample_without_enumerating():
    train, evals = arithmetic_examples(digits=6, ops=["+"], train_size=1000, eval_size=100, seed=1)
    assert len(train) == 1000 and len(evals) == 100
    assert not {e.prompt for e in evals} & {e.prompt for e in train}
    _check_answers(train)


def test_arithmetic_rejects_an_eval_set_that_swallows_everything():
    with pytest.raises(DataError, match="no training problems"):
        arithmetic_examples(digits=1, ops=["+"], train_size=10, eval_size=100, seed=0)


def test_load_task_follows_config_knobs():
    cfg = parse_config({"data": {"arithmetic": {"digits": 3, "ops": ["*"], "train_size": 40,
                                                "eval_size": 9}}, "seed": 3})
    train, evals = load_task(cfg)
    assert (len(train), len(evals)) == (40, 9)
    assert all("*" in ex.prompt for ex in train)
    assert load_task(cfg) == (train, evals)


def test_jsonl_and_parquet_prompt_files(tmp_path):
    rows = [{"question": f"q{i}", "solution": i * 2} for i in range(30)]
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    parquet = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    for path in (jsonl, parquet):
        examples = load_rows(str(path), prompt_key="question", answer_key="solution")
        assert examples[3] == Example(prompt="q3", answer="6")
        assert len(examples) == 30
    cfg = parse_config({"data": {"path": str(jsonl), "prompt_key": "question",
                                 "answer_key": "solution"}, "eval": {"size": 100}})
    train, evals = load_task(cfg)
    assert len(evals) == 3 and len(train) == 27  # at most a tenth held out
    assert not {e.prompt for e in evals} & {e.prompt for e in train}


def test_eval_path_and_missing_answers(tmp_path):
    train_file = tmp_path / "train.jsonl"
    train_file.write_text('{"prompt": "hello"}\n')
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text('{"prompt": "bye", "answer": "x"}\n')
    cfg = parse_config({"data": {"path": str(train_file), "eval_path": str(eval_file)}})
    assert load_task(cfg) == ([Example("hello", None)], [Example("bye", "x")])
    with pytest.raises(DataError, match="needs an answer"):
        sft_target(Example("hello", None))


def test_bad_files_say_what_is_wrong(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2"):
        load_rows(str(bad))
    wrong_key = tmp_path / "k.jsonl"
    wrong_key.write_text('{"text": "a"}\n')
    with pytest.raises(DataError, match="no 'prompt' key"):
        load_rows(str(wrong_key))
    with pytest.raises(DataError, match="no such file"):
        load_rows(str(tmp_path / "missing.jsonl"))


def test_hub_ids_need_the_datasets_package():
    try:
        import datasets  # noqa: F401
    except ModuleNotFoundError:
        with pytest.raises(DataError, match="`datasets` package"):
            load_rows("openai/gsm8k:main")
    else:
        pytest.skip("datasets is installed; hub loading needs a network this machine lacks")


def test_sft_target_and_task_text():
    cfg = parse_config({"data": {"arithmetic": {"train_size": 20, "eval_size": 5}}})
    train, evals = load_task(cfg)
    assert sft_target(train[0]) == train[0].answer
    text = task_text(cfg)
    assert len(text) == 25 and text[0] == train[0].prompt + train[0].answer


def test_digits_means_exactly_that_many_digits():
    train, evals = arithmetic_examples(digits=2, ops=["+", "-"], train_size=20_000, eval_size=10,
                                       seed=0)
    for ex in train + evals:
        a, b = (int(x) for x in ex.prompt[:-1].replace("-", "+").split("+"))
        assert 10 <= a <= 99 and 10 <= b <= 99
    assert len(train) + len(evals) == 90 * 90 + 90 * 91 // 2
