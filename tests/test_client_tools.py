"""The tools people point at a serving engine, run unchanged against a real ``tidal serve`` (CPU, tiny
checkpoint): guidellm (vLLM's benchmark tool), lm-eval's ``local-completions`` (log-likelihoods and
``generate_until``) and ``tidal bench``; and ``transformers.AutoTokenizer`` on a ``tidal checkpoint``.

Each tool's own numbers are checked against something independent: guidellm's token counts against the usage the
tap reports for the same request, lm-eval's log-likelihoods against ``LLM.score``'s log-softmax on the same
tokens, its generations against ``LLM.generate``, AutoTokenizer's ids against tidal's own tokenizer (its tiktoken
path).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

BIN = os.path.dirname(sys.executable)
TOOL_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}
MC = [{"question": "The tide comes in and", "choices": [" goes out", " stays", " sings"], "answer": 0},
      {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
      {"question": "Paris is the capital of", "choices": [" France", " Spain", " Italy", " Peru"], "answer": 0}]
GEN = [{"prompt": "Count: one, two,", "target": " three"}, {"prompt": "The sea is", "target": " blue"}]
MAX_GEN = 6


@pytest.fixture(scope="module")
def served(server, tap):
    return server, tap


def run_tool(cmd: list[str], cwd, timeout: float = 300) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=cwd, env={**os.environ, **TOOL_ENV}, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, f"{cmd[0]} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def test_auto_tokenizer_gives_tidal_s_ids(tmp_path):
    from transformers import AutoTokenizer

    from tidal.executor.presets import write_checkpoint
    from tidal.tokenizer import HFTokenizer, TiktokenTokenizer, load_tokenizer

    path = write_checkpoint("tiny", str(tmp_path / "tiny"), weights=False)
    ours = load_tokenizer(path)
    assert isinstance(ours, TiktokenTokenizer)
    hf = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "Hi! 人力资源管理 — café naïve 😀\n\tcode: x = [1, 2]  # ok"},
                {"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "And   now?"}]
    got = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    got = got["input_ids"] if not isinstance(got, list) else got
    assert got == ours.apply_chat_template(messages, add_generation_prompt=True)
    for text in ("I'LL go, we're here", " leading and trailing   ", "e\u0301 composed", "12345678 + 0.5",
                 "مرحبا Привет こんにちは", "a" * 300):
        assert hf.encode(text, add_special_tokens=False) == ours.encode(text), text
    assert hf.decode(got) == ours.decode(got, skip_special=False)
    assert hf.eos_token_id == 248046 and len(hf) == ours.n_vocab
    # tidal's own reader of a tokenizer.json (the path real checkpoints take) agrees with its tiktoken path too.
    other = HFTokenizer(os.path.join(path, "tokenizer.json"), ours.eos_token_ids, ours.chat_template)
    assert other.apply_chat_template(messages, add_generation_prompt=True) == got


def test_guidellm_at_concurrency_1_and_4(served, tmp_path, tiny_checkpoint):
    srv, tap = served
    requests = 8
    out = tmp_path / "guidellm.json"
    # One run of guidellm, a benchmark at each concurrency.
    run_tool([os.path.join(BIN, "guidellm"), "run", "--backend", f"kind=openai_http,target={srv.url}",
              "--data", "kind=synthetic_text,prompt_tokens=24,output_tokens=6",
              "--profile", "kind=concurrent", "--override", "profile.streams", "1,4",
              "--constraint", f"kind=max_requests,count={requests}",
              "--tokenizer", f"kind=huggingface_auto,model={tiny_checkpoint}", "--output", f"kind=json,path={out}",
              "--disable-console-interactive"], tmp_path)
    benches = json.loads(out.read_text())["benchmarks"]
    assert [b["config"]["strategy"]["streams"] for b in benches] == [1, 4]
    for bench in benches:
        reqs = bench["requests"]
        assert reqs["errored"] == [] and reqs["incomplete"] == [], (reqs["errored"][:1], reqs["incomplete"][:1])
        # guidellm may close a max_requests benchmark with its last request still in flight (its scheduler state
        # then counts it as processing, not in any list): every request it created is answered or in flight.
        state = bench["scheduler_state"]
        assert state["created_requests"] == requests and state["errored_requests"] == 0
        assert len(reqs["successful"]) + state["processing_requests"] == requests, state
        assert len(reqs["successful"]) >= requests - 1, state
        for r in reqs["successful"]:
            rid = r["response_id"].split("-", 1)[1]
            _, ids, final = tap.wait_finished(rid)
            assert r["input_metrics"]["text_tokens"] == final["usage"]["prompt_tokens"]
            assert r["output_metrics"]["text_tokens"] == final["usage"]["completion_tokens"] == len(ids) == 6
    assert srv.wait_idle()["tidal_requests_running"] == 0


def _lm_eval_tasks(folder) -> None:
    os.makedirs(folder)
    with open(os.path.join(folder, "mc.json"), "w") as f:
        f.write("\n".join(json.dumps(d) for d in MC))
    with open(os.path.join(folder, "gen.json"), "w") as f:
        f.write("\n".join(json.dumps(d) for d in GEN))
    with open(os.path.join(folder, "tidal_mc.yaml"), "w") as f:
        f.write(f"""task: tidal_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {os.path.join(folder, "mc.json")}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - metric: acc
""")
    with open(os.path.join(folder, "tidal_gen.yaml"), "w") as f:
        f.write(f"""task: tidal_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {os.path.join(folder, "gen.json")}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {MAX_GEN}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")


def _pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) pair into token ids (``TemplateLM._encode_pair``)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


def test_lm_eval_local_completions(served, tmp_path, tiny_checkpoint):
    from transformers import AutoTokenizer

    from tidal import LLM

    srv, _ = served
    tasks = tmp_path / "tasks"
    _lm_eval_tasks(str(tasks))
    run_tool([os.path.join(BIN, "lm_eval"), "--model", "local-completions", "--model_args",
              f"model=tiny,base_url={srv.url}/v1/completions,tokenizer={tiny_checkpoint},num_concurrent=1,"
              "max_retries=1,tokenized_requests=True", "--tasks", "tidal_mc,tidal_gen", "--include_path", str(tasks),
              "--output_path", str(tmp_path / "out"), "--log_samples"], tmp_path, timeout=400)
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    llm = LLM(tiny_checkpoint, dtype="float32")
    [mc_file] = glob.glob(str(tmp_path / "out" / "**" / "samples_tidal_mc_*.jsonl"), recursive=True)
    mc = [json.loads(line) for line in open(mc_file)]
    assert len(mc) == len(MC)
    scored = 0
    for sample in mc:
        for i, args in enumerate(sample["arguments"].values()):
            ctx, cont = _pair(tok, args["arg_0"], args["arg_1"])
            logprobs = torch.log_softmax(llm.score(ctx + cont).float(), dim=-1)
            expected = sum(float(logprobs[len(ctx) + j - 1, t]) for j, t in enumerate(cont))
            got = float(sample["resps"][i][0][0])
            assert abs(got - expected) <= 1e-4, (args, got, expected)
            scored += 1
    assert scored == sum(len(d["choices"]) for d in MC)
    [gen_file] = glob.glob(str(tmp_path / "out" / "**" / "samples_tidal_gen_*.jsonl"), recursive=True)
    gen = [json.loads(line) for line in open(gen_file)]
    assert len(gen) == len(GEN)
    for sample in gen:
        prompt = sample["arguments"]["gen_args_0"]["arg_0"]
        ids = llm.generate([tok.encode(prompt, add_special_tokens=False)], max_tokens=MAX_GEN)[0]
        text = tok.decode(ids, skip_special_tokens=True).split("\n")[0]
        assert sample["resps"][0][0] == text, (prompt, sample["resps"][0][0], text)
    assert srv.wait_idle()["tidal_requests_running"] == 0


def test_tidal_bench_against_the_same_server(served, tmp_path):
    srv, _ = served
    out = tmp_path / "bench"
    run_tool([sys.executable, "-m", "tidal.cli", "bench", "--base-url", srv.url, "--out", str(out),
              "--prompt-tokens", "64", "--extra-tokens", "16", "--max-tokens", "4", "--warmups", "1", "--pairs", "1",
              "--requests", "4", "--concurrency", "4", "--request-rate", "inf", "--tap-addr", srv.tap_addr],
             tmp_path)
    report = json.loads((out / "bench.json").read_text())
    checks = report["checks"]
    assert checks["passed"] and checks["failed_requests"] == 0, checks["failures"]
    assert checks["requests"] == 2 * 2 + 4  # a warm-up pair, a scored pair, the open loop
    assert report["cached_tokens_source"] == "tap"
