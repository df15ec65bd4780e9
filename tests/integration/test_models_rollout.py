"""A tiny model built here, loaded by transformers and by vLLM (CPU), sampled and re-weighted.

One vLLM engine serves the whole module (engine start is the expensive part on 2 cores).
"""

import os
import threading

import psutil
import pytest
import torch

from trainer.algorithms import pack, response_logprobs, sft_batch, sft_loss
from trainer.config import parse_config
from trainer.data import load_task, sft_target, task_text
from trainer.models import PRESETS, ensure_model, make_tiny_model
from trainer.rollout import make_engine

pytestmark = pytest.mark.slow

PROMPTS = ["12+35=", "7+8=", "40+2="]


def _cfg(model_dir, **rollout):
    return parse_config({
        "model": {"path": str(model_dir), "preset": "nano"},
        "data": {"arithmetic": {"train_size": 2000, "eval_size": 50}},
        # fp32: these tests hold vLLM to HF's fp32 numbers; the bf16 sampler has its own test
        "rollout": {"engine": "vllm", "max_new_tokens": 6, "kv_cache_gb": 0.25, "dtype": "float32",
                    **rollout},
        "placement": {"device_type": "cpu"},
    })


def _sft(model, tokenizer, examples, steps, lr=3e-3, seed=0):
    """A few SFT steps so the model's outputs are peaked (no near-ties between engines)."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        idx = torch.randint(len(examples), (64,), generator=gen).tolist()
        batch = sft_batch(tokenizer, [examples[i].prompt for i in idx],
                          [sft_target(examples[i]) for i in idx])
        from trainer.algorithms import response_logits

        loss = sft_loss(response_logits(model, batch), batch.response_ids, batch.response_mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # One torch thread: on a busy 2-core machine two OpenMP threads spin-wait each other
    # (measured: 0.04 s vs 1.6 s per SFT step of this model).
    torch.set_num_threads(1)
    model_dir = tmp_path_factory.mktemp("models") / "nano"
    cfg = _cfg(model_dir)
    ensure_model(cfg)
    tok = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    trained = AutoModelForCausalLM.from_pretrained(model_dir)
    train, _ = load_task(cfg)
    loss = _sft(trained, tok, train, steps=120)
    assert loss < 1.5, loss  # it learned something: answers end in EOS and are digits
    return cfg, model_dir, tok, base, trained


@pytest.fixture(scope="module")
def vllm_engine(built):
    cfg, model_dir, *_ = built
    engine = make_engine(cfg, model_dir, threads=1, seed=0)
    yield engine
    engine.close()


def test_tiny_model_presets_and_tokenizer(built, tmp_path):
    cfg, model_dir, tok, base, _ = built
    assert sum(p.numel() for p in base.parameters()) < 300_000
    assert tok.eos_token_id is not None and tok.pad_token_id is not None
    assert tok.eos_token_id != tok.pad_token_id
    ids = tok("12+35=47", add_special_tokens=False).input_ids
    assert len(ids) == 8  # digits are single tokens
    assert tok.decode(ids) == "12+35=47"
    assert tok.decode(tok("any text, even ünïcode").input_ids) == "any text, even ünïcode"
    # the micro preset sits near 1M parameters, small near 18M (computed from the config only)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    for name, lo, hi in (("micro", 0.8e6, 1.3e6), ("small", 15e6, 20e6)):
        p = PRESETS[name]
        with torch.device("meta"):
            m = Qwen2ForCausalLM(Qwen2Config(
                vocab_size=len(tok), hidden_size=p.hidden, intermediate_size=p.intermediate,
                num_hidden_layers=p.layers, num_attention_heads=p.heads,
                num_key_value_heads=p.kv_heads, tie_word_embeddings=True))
        assert lo < sum(x.numel() for x in m.parameters()) < hi, name


def test_ensure_model_builds_once_under_concurrency(tmp_path):
    target = tmp_path / "m"
    cfg = parse_config({"model": {"path": str(target), "preset": "nano"},
                        "data": {"arithmetic": {"train_size": 100, "eval_size": 10}}})
    errors = []

    def build():
        try:
            ensure_model(cfg)
        except Exception as exc:  # pragma: no cover - the assertion below reports it
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["m"]
    assert not [p for p in tmp_path.iterdir() if p.is_dir() and p.name.startswith(".")]
    assert (target / "model.safetensors").exists() and (target / "tokenizer.json").exists()
    with pytest.raises(FileExistsError):
        make_tiny_model(target, "nano", task_text(cfg))


def _hf_greedy(model, tok, prompts, max_new_tokens):
    out = []
    for p in prompts:
        ids = tok(p, return_tensors="pt", add_special_tokens=False).input_ids
        gen = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
        if tok.eos_token_id in gen:
            gen = gen[: gen.index(tok.eos_token_id) + 1]
        out.append(gen)
    return out


def test_vllm_samples_grouped_with_logprobs_of_the_sampler(built, vllm_engine):
    cfg, _, tok, base, _ = built
    samples = vllm_engine.generate(PROMPTS, n=3)
    assert [s.prompt for s in samples] == [p for p in PROMPTS for _ in range(3)]
    for s in samples:
        assert s.prompt_ids == tok(s.prompt, add_special_tokens=False).input_ids
        assert 1 <= len(s.response_ids) <= 6 and len(s.logprobs) == len(s.response_ids)
        assert s.finish_reason in ("stop", "length")
        if s.finish_reason == "stop":
            assert s.response_ids[-1] == tok.eos_token_id
        decoded = tok.decode(s.response_ids, skip_special_tokens=True)
        if "\ufffd" not in decoded:  # a random model may emit partial UTF-8; vLLM holds it back
            assert s.response_text == decoded
    # the engine's log-probs are the (untrained, random-init) policy's own, token by token
    batch = pack([s.prompt_ids for s in samples], [s.response_ids for s in samples], tok.pad_token_id)
    with torch.no_grad():
        hf_lp, _ = response_logprobs(base, batch)
    for i, s in enumerate(samples):
        assert hf_lp[i, : len(s.logprobs)].tolist() == pytest.approx(s.logprobs, abs=2e-3)


def test_vllm_texts_are_decoded_once_unless_stop_strings_need_vllms_text(built, vllm_engine):
    """Without stop strings vLLM skips its token-by-token detokenization (and the decoding of each
    token's log-prob entry) and keeps the log-probs in flat lists: the text is decoded once from
    the ids. With a stop string vLLM builds the text, matches on it and cuts there."""
    cfg, _, tok, base, trained = built
    greedy = cfg.rollout.model_copy(update={"temperature": 0.0})
    vllm_engine.rollout = greedy
    try:
        vllm_engine.update_weights(trained.state_dict().items())  # answers in digits, then EOS
        params = vllm_engine._params(1)
        assert params.detokenize is False and params.flat_logprobs is True
        plain = vllm_engine.generate(PROMPTS, n=1)
        texts = [s.response_text for s in plain]
        assert all(t and t.isdigit() for t in texts), texts
        assert texts == [tok.decode(s.response_ids, skip_special_tokens=True) for s in plain]
        assert all(len(s.logprobs) == len(s.response_ids) and s.finish_reason == "stop" for s in plain)
        # stopped at an answer's last digit: the text ends before that digit's first occurrence
        long = next(t for t in texts if len(t) >= 2)
        vllm_engine.rollout = greedy.model_copy(update={"stop": [long[-1]]})
        assert vllm_engine._params(1).detokenize is True
        cut = vllm_engine.generate([PROMPTS[texts.index(long)]], n=1)[0]
        assert cut.response_text == long.split(long[-1])[0] and cut.finish_reason == "stop"
        assert len(cut.logprobs) == len(cut.response_ids) >= 1
    finally:
        vllm_engine.rollout = cfg.rollout
        vllm_engine.update_weights(base.named_parameters())


def test_vllm_weight_update_matches_transformers_greedy(built, vllm_engine):
    cfg, _, tok, base, trained = built
    greedy = parse_config({**cfg.model_dump(), "rollout": {**cfg.rollout.model_dump(),
                                                           "temperature": 0.0}})
    vllm_engine.rollout = greedy.rollout
    try:
        # (the random-init model's logits are near ties, so only the trained one is compared)
        before = [s.response_ids for s in vllm_engine.generate(PROMPTS, n=1)]
        # no disk involved; a state dict also names the tied lm_head.weight, vLLM aliases it
        vllm_engine.update_weights(trained.state_dict().items())
        after = [s.response_ids for s in vllm_engine.generate(PROMPTS, n=1)]
        expected = _hf_greedy(trained, tok, PROMPTS, 6)
        assert after == expected, (after, expected, before)
        assert after != before
        # the trained model answers in digits and stops
        texts = [s.response_text for s in vllm_engine.generate(PROMPTS, n=1)]
        assert all(t and t.isdigit() for t in texts), texts
        # and back: the original weights give the original outputs again (the tied LM head
        # included, which vLLM's CPU reload alone leaves stale; see trainer/rollout/vllm_engine.py)
        vllm_engine.update_weights(base.named_parameters())
        assert [s.response_ids for s in vllm_engine.generate(PROMPTS, n=1)] == before
    finally:
        vllm_engine.rollout = cfg.rollout
        vllm_engine.update_weights(base.named_parameters())


def test_vllm_cpu_in_place_load_equals_vllms_own_reload(built, vllm_engine):
    """The CPU engine's own in-place load (trainer/rollout/vllm_engine.py `_load_cpu_in_place`,
    used for every update of a Qwen2 engine without tensor parallelism) leaves every parameter
    bit for bit where vLLM's layer-wise reload does (fused q/k/v and gate/up included), and a
    misnamed or missing tensor is an error, not a silent partial load."""
    _, _, _, base, trained = built

    def snapshot(worker):  # the worker's parameters (a packed layer's weight lives in its GEMM)
        return {n: p.detach().clone() for n, p in worker.model_runner.get_model().named_parameters()}

    def load(in_place: bool, weights) -> dict[str, torch.Tensor]:
        vllm_engine._in_place = in_place
        vllm_engine.update_weights(weights)
        return vllm_engine.llm.collective_rpc(snapshot)[0]

    try:
        assert load(None, base.named_parameters()) and vllm_engine._in_place is True  # chosen on its own
        reloaded = load(False, trained.state_dict().items())
        load(True, base.named_parameters())
        in_place = load(True, trained.state_dict().items())
        assert reloaded.keys() == in_place.keys()
        assert all(torch.equal(reloaded[n], in_place[n]) for n in reloaded), \
            [n for n in reloaded if not torch.equal(reloaded[n], in_place[n])]
        # the trained weights really arrived (a norm differs from the base model's)
        norm = "model.layers.0.input_layernorm.weight"
        assert not torch.equal(in_place[norm], load(True, base.named_parameters())[norm])
        with pytest.raises(KeyError, match="nope"):
            vllm_engine.update_weights([("model.layers.0.nope.weight", torch.zeros(1))])
        with pytest.raises(ValueError, match="qkv_proj"):  # v_proj never came
            vllm_engine.update_weights([(n, t) for n, t in base.named_parameters() if "v_proj" not in n])
    finally:
        vllm_engine._in_place = None
        vllm_engine.update_weights(base.named_parameters())


def test_vllm_cpu_engine_norms_run_vllms_c_kernels(built, vllm_engine):
    """The eager CPU engine dispatches its RMSNorms to vLLM-CPU's C++ kernels
    (trainer/rollout/vllm_cpu_norms.py), which give the native path's numbers: in fp32 to rounding,
    in bf16 within a bf16 step or two; a strided input the kernels cannot take goes native. (The greedy
    and log-prob tests above run this engine, so they hold the kernels to HF's numbers too.)"""
    from vllm import ir

    from trainer.rollout.vllm_cpu_norms import PROVIDER

    assert ir.ops.rms_norm.get_priority()[0] == PROVIDER
    assert ir.ops.fused_add_rms_norm.get_priority()[0] == PROVIDER
    gen = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 0.07)):
        x = torch.randn(16, 128, generator=gen).to(dtype) * 3
        res = torch.randn(16, 128, generator=gen).to(dtype)
        w = (torch.rand(128, generator=gen) + 0.5).to(dtype)
        assert ir.ops.rms_norm.dispatch(x, w, 1e-6).provider == PROVIDER
        native = ir.ops.rms_norm.impls["native"].impl_fn(x, w, 1e-6)
        assert (ir.ops.rms_norm(x, w, 1e-6).float() - native.float()).abs().max() < tol
        n_out, n_res = ir.ops.fused_add_rms_norm.impls["native"].impl_fn(x, res, w, 1e-6)
        xi, ri = x.clone(), res.clone()  # the in-place form, as the decoder layers call it
        out, summed = ir.ops.fused_add_rms_norm.maybe_inplace(xi, ri, w, 1e-6)
        assert out.data_ptr() == xi.data_ptr() and summed.data_ptr() == ri.data_ptr()
        assert (out.float() - n_out.float()).abs().max() < tol
        assert (summed.float() - n_res.float()).abs().max() < tol
        # the functional form leaves its inputs alone
        x0 = x.clone()
        ir.ops.fused_add_rms_norm(x, res, w, 1e-6)
        assert torch.equal(x, x0)
        strided = x.t().contiguous().t()
        assert ir.ops.rms_norm.dispatch(strided, w, 1e-6).provider == "native"
    assert len(vllm_engine.generate(["1+1="], n=2)) == 2


def test_vllm_cpu_engine_counts_sampled_ranks_without_compiling(vllm_engine):
    """A CPU engine's sampler counts each sampled token's rank eagerly at a small vocabulary
    (trainer/rollout/vllm_cpu_ranks.py), so a generate with log-probs never reaches vLLM's
    compiled count (an Inductor compile, 1.3-10.8 s, on an engine's first generate); the count is
    each row's tokens at least as likely as the sampled one, and a large vocabulary still goes to
    vLLM's compiled function."""
    from vllm.v1.sample import sampler

    count = sampler.batched_count_greater_than
    assert getattr(count, "_yatt_eager_small_vocab", False), "the engine did not install the eager count"
    calls = []
    compiled = count.compiled
    count.compiled = lambda x, v: calls.append(tuple(x.shape)) or (x >= v).sum(-1)
    try:
        samples = vllm_engine.generate(PROMPTS, n=4)
        assert calls == [] and all(len(s.logprobs) == len(s.response_ids) >= 1 for s in samples)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(12, 258, generator=gen).log_softmax(-1)
        x[3, 7] = x[3, 5]  # a tie counts as at least as likely
        picked = torch.tensor([0, 9, 100, 5, 257, 1, 2, 3, 4, 6, 8, 10])
        values = x.gather(-1, picked[:, None])
        # the rank by sorting each row: its length less the entries sorted below the sampled value
        ascending = x.sort(dim=-1).values
        by_sort = x.shape[-1] - torch.searchsorted(ascending, values, right=False).squeeze(-1)
        assert torch.equal(count(x, values), by_sort) and by_sort[3] >= 2
        assert calls == []
        wide = torch.randn(2, 4096, generator=gen)
        assert torch.equal(count(wide, wide[:, :1]), (wide >= wide[:, :1]).sum(-1))
        assert calls == [(2, 4096)]
    finally:
        count.compiled = compiled


def test_vllm_cpu_engine_allocates_the_kv_cache_its_scheduler_can_fill(built, vllm_engine):
    """`rollout.kv_cache_gb` is 0.25 GiB here, room for 524,288 tokens of this model's KV in fp32;
    a generate of this run holds at most 16 prompts × 8 samples, so the scheduler runs 128
    sequences of 512 tokens and the engine allocates (and zeroes at start) the cache for 65,536
    (trainer/placement/memory.py, cpu_max_num_seqs and cpu_kv_cache_bytes). A generate of more
    sequences than that is served in waves, each prompt's samples as they would be at once."""
    cfg, model_dir, *_ = built
    from trainer.placement.memory import cpu_kv_cache_bytes, read_shape

    vc = vllm_engine.llm.llm_engine.vllm_config
    held = vc.cache_config.num_gpu_blocks * vc.cache_config.block_size
    per_token = 2 * 2 * 1 * 32 * 4  # layers, K and V, one KV head of 32, fp32
    assert vc.scheduler_config.max_num_seqs == 128 and vc.model_config.max_model_len == 512
    assert held == 128 * 512 < int(0.25 * 2**30) // per_token
    assert cpu_kv_cache_bytes(cfg, read_shape(str(model_dir))) == held * per_token
    # 150 prompts × 1 greedy sample, over the 128 the scheduler runs at once
    prompts = [f"{a}+{b}=" for a in range(10, 25) for b in range(10)]
    params = vllm_engine._params(1)
    params.temperature = 0.0
    greedy = [o.outputs[0].token_ids for o in vllm_engine.llm.generate(prompts, params, use_tqdm=False)]
    assert len(greedy) == len(prompts) and all(greedy)
    apart = [o.outputs[0].token_ids for p in (prompts[:75], prompts[75:])
             for o in vllm_engine.llm.generate(p, params, use_tqdm=False)]
    assert greedy == apart


def test_vllm_sleep_is_a_documented_noop_on_cpu(vllm_engine):
    rss = psutil.Process(os.getpid()).memory_info().rss
    vllm_engine.sleep()
    freed = rss - psutil.Process(os.getpid()).memory_info().rss
    vllm_engine.wake()
    assert vllm_engine.sleep_supported is False
    assert freed < 50 * 2**20  # vLLM's CPU backend keeps its KV cache while "asleep"
    assert len(vllm_engine.generate(["1+1="], n=2)) == 2


def test_hf_engine_same_interface_and_greedy_as_vllm(built):
    cfg, model_dir, tok, _, trained = built
    hf_cfg = parse_config({**cfg.model_dump(), "rollout": {**cfg.rollout.model_dump(),
                                                           "engine": "hf"}})
    engine = make_engine(hf_cfg, model_dir, threads=1, seed=0)
    samples = engine.generate(PROMPTS, n=4)
    assert [s.prompt for s in samples] == [p for p in PROMPTS for _ in range(4)]
    batch = pack([s.prompt_ids for s in samples], [s.response_ids for s in samples], tok.pad_token_id)
    with torch.no_grad():
        lp, _ = response_logprobs(engine.model, batch)
    for i, s in enumerate(samples):
        assert len(s.logprobs) == len(s.response_ids) <= 6
        assert lp[i, : len(s.logprobs)].tolist() == pytest.approx(s.logprobs, abs=1e-4)
    engine.update_weights(trained.named_parameters())
    engine.rollout = engine.rollout.model_copy(update={"temperature": 0.0})
    greedy = [s.response_ids for s in engine.generate(PROMPTS, n=1)]
    assert greedy == _hf_greedy(trained, tok, PROMPTS, 6)
    # a stop string cuts the text before it and keeps the token that completed it
    text = tok.decode(greedy[0], skip_special_tokens=True)
    assert len(text) >= 2, text
    engine.rollout = engine.rollout.model_copy(update={"stop": [text[1]]})
    (cut,) = engine.generate(PROMPTS[:1], n=1)
    assert cut.response_text == text[: text.index(text[1])]
    assert cut.finish_reason == "stop" and cut.response_ids == greedy[0][: text.index(text[1]) + 1]
    with pytest.raises(KeyError):
        engine.update_weights([("nope.weight", torch.zeros(1))])
    engine.close()


def test_bf16_sampler_loads_the_trainers_fp32_weights_and_stays_close_to_them(built):
    """`rollout.dtype: auto` on a CPU with native bf16 (AMX, AVX512-BF16) samples in bf16 from the
    trainer's fp32 weights, and keeps fp32 on one without (AVX2 only), where the same bf16 engine is
    asked for by name (emulated: slower, same numbers): its log-probs are near the fp32 model's
    (the mismatch TIS corrects), and a weight update in fp32 reaches it (the trained model answers
    in digits). After every test of the module's engine: with a second vLLM engine alive in the
    process, the first one's later weight reload no longer matched HF greedy (seen when this test
    ran before that one)."""
    from trainer.learner import native_bf16
    from trainer.precision import sampler_dtype

    cfg, model_dir, tok, base, trained = built
    auto = _cfg(model_dir, dtype="auto")
    native = native_bf16(torch.device("cpu"))
    assert sampler_dtype(auto, "cpu") == ("bfloat16" if native else "float32")
    bf16 = auto if native else _cfg(model_dir, dtype="bfloat16")
    assert sampler_dtype(bf16, "cpu") == "bfloat16"
    engine = make_engine(bf16, model_dir, threads=1, seed=0)
    try:
        engine.update_weights(trained.state_dict().items())
        samples = engine.generate(PROMPTS, n=3)
        batch = pack([s.prompt_ids for s in samples], [s.response_ids for s in samples], tok.pad_token_id)
        with torch.no_grad():
            fp32_lp, _ = response_logprobs(trained, batch)
        diffs = [abs(a - b) for i, s in enumerate(samples)
                 for a, b in zip(fp32_lp[i, : len(s.logprobs)].tolist(), s.logprobs, strict=True)]
        assert 0 < sum(diffs) / len(diffs) < 0.05, sum(diffs) / len(diffs)  # bf16, not fp32, not off
        greedy = parse_config({**bf16.model_dump(), "rollout": {**bf16.rollout.model_dump(),
                                                                 "temperature": 0.0}})
        engine.rollout = greedy.rollout
        texts = [s.response_text for s in engine.generate(PROMPTS, n=1)]
        assert all(t and t.isdigit() for t in texts), texts
    finally:
        engine.close()


def test_compiled_vllm_engine_takes_weight_updates_and_loads_its_compiled_model(built):
    """`rollout.compile`: vLLM's compiled model reads the weights the in-place load put in its
    layers (new GEMM handles, new tensors): after an update its greedy output is transformers'
    for the new weights, and after the old weights are back, its old output again. The second
    engine of the same configuration loads the model the first one compiled and saved
    (vllm_cpu_aot.py; before it, every load failed and each engine compiled again) and follows
    its weights the same way. At the end of the file, like the bf16 engine's test: a second
    engine alive in the process disturbs the module engine's later reloads."""
    from vllm.compilation.counter import compilation_counter

    cfg, model_dir, tok, base, trained = built
    compiled = _cfg(model_dir, compile=True, temperature=0.0)
    outputs = []
    for _ in range(2):
        loaded = compilation_counter.num_aot_artifacts_loaded
        engine = make_engine(compiled, model_dir, threads=1, seed=0)
        try:
            before = [s.response_ids for s in engine.generate(PROMPTS, n=1)]
            engine.update_weights(trained.state_dict().items())
            after = [s.response_ids for s in engine.generate(PROMPTS, n=1)]
            assert after == _hf_greedy(trained, tok, PROMPTS, 6) and after != before
            engine.update_weights(base.named_parameters())
            assert [s.response_ids for s in engine.generate(PROMPTS, n=1)] == before
            outputs.append(before)
        finally:
            engine.close()
    # the second engine found the first one's artifact (the first may have found an earlier one)
    assert compilation_counter.num_aot_artifacts_loaded == loaded + 1
    assert outputs[1] == outputs[0]
