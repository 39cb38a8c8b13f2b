"""The GPU forward as a fixed sequence of launches: no host sync inside the model (bf16, Triton
kernels, flash-linear-attention when installed), on a batch mixing prefill chunks, decodes and a
checkpoint export inside a segment."""

from __future__ import annotations

import pytest
import torch

from tidal import LLM
from tidal.messages import SegmentSpec


@pytest.mark.gpu
def test_model_forward_never_syncs_with_the_host(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, device="cuda", dtype="bfloat16")
    runner = llm.runner
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 240000, (400,), generator=gen).tolist()
    # Requests 0-2 already hold 100 tokens of state; request 3 starts fresh with an export at 64.
    for slot in range(3):
        pages = list(range(slot * 20, slot * 20 + 8))
        runner.execute(llm_batch([SegmentSpec(rid=f"r{slot}", slot=slot, start=0, token_ids=ids[:100], pages=pages)]))
    specs = [SegmentSpec(rid="r0", slot=0, start=100, token_ids=[ids[100]], pages=list(range(0, 8)), sample=True),
             SegmentSpec(rid="r1", slot=1, start=100, token_ids=ids[100:230], pages=list(range(20, 35)), sample=True),
             SegmentSpec(rid="r2", slot=2, start=100, token_ids=[ids[101]], pages=list(range(40, 48)), sample=True),
             SegmentSpec(rid="r3", slot=3, start=0, token_ids=ids[:150], pages=list(range(60, 70)), sample=True,
                         exports=[[64, 9]])]
    order = sorted(range(len(specs)), key=lambda i: len(specs[i].token_ids) != 1)
    fb = runner._forward_batch([specs[i] for i in order])  # builds device metadata (host-to-device copies)
    with torch.inference_mode():
        runner.model(fb)  # first launch at these shapes: compilation and autotuning may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            streams, pending = runner.model(fb)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(streams.float()).all()


def llm_batch(segments):
    from tidal.messages import Batch

    return Batch(batch_id=0, segments=segments)


@pytest.mark.gpu
def test_prompt_logprobs_on_the_device_equal_score(tiny_checkpoint):
    """Echo's prompt log-probabilities (the runner's blocks of prompt rows, over two prefill chunks)
    against log_softmax of ``LLM.score`` on the same device, float32."""
    from tidal.messages import Detokenize, GenerateReq

    llm = LLM(tiny_checkpoint, device="cuda", dtype="float32", max_prefill_length=300)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1000, 240000, (500,), generator=gen).tolist()
    llm.scheduler.add_request(GenerateReq(rid="e", prompt_ids=ids, max_tokens=0, prompt_logprobs=3))
    entries = [e for ev in llm._run() if isinstance(ev, Detokenize) and ev.prompt_logprobs
               for e in ev.prompt_logprobs]
    ref = llm.score(ids).log_softmax(-1)
    assert len(entries) == len(ids) - 1
    got = torch.tensor([e.logprob for e in entries])
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    top = ref[:-1].topk(3, dim=-1)  # values, not ids: near-ties may order differently between two GEMMs
    torch.testing.assert_close(torch.tensor([e.top_logprobs for e in entries]), top.values, atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_graph_replays_equal_eager_steps(tiny_checkpoint, dtype):
    """Decode steps replayed from CUDA graphs (padded batches, QSA block buckets, a one-token prompt on
    a reused slot, a prefix-cache hit) give the ids of the same steps run eagerly."""
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1000, 240000, (n,), generator=gen).tolist() for n in (37, 1, 100)]
    eager = LLM(tiny_checkpoint, device="cuda", dtype=dtype, max_prefill_length=64, max_running_requests=3,
                disable_cuda_graph=True)
    graphed = LLM(tiny_checkpoint, device="cuda", dtype=dtype, max_prefill_length=64, max_running_requests=3)
    assert eager.runner.graphs is None and graphed.runner.graphs.capture
    for llm_round in range(2):
        want = eager.generate(prompts, max_tokens=40, ignore_eos=True)
        assert graphed.generate(prompts, max_tokens=40, ignore_eos=True) == want, llm_round
    longer = prompts[2] + want[2] + prompts[0]
    assert graphed.generate([longer], max_tokens=20, ignore_eos=True) == eager.generate([longer], max_tokens=20,
                                                                                         ignore_eos=True)
    assert graphed.runner.stats()["cuda_graph_replays"][0] >= 2 * 39 + 19


@pytest.mark.gpu
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_decode_steps_launched_ahead_equal_steps_one_by_one(tiny_checkpoint, sampling):
    """Graph replays launched before the step before them is finished (token -1, read on the device, as
    the executor's loop runs decodes sent ahead) give the ids of steps run one after the other; a prompt
    joining mid-way makes the runner finish the pending step first."""
    from test_decode_graphs import _decode_steps

    from tidal.messages import SamplingParams

    params = None if sampling == "greedy" else SamplingParams(temperature=0.8, top_k=40, seed=5)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1000, 240000, (n,), generator=gen).tolist() for n in (30, 9)]
    extra = {6: torch.randint(1000, 240000, (12,), generator=gen).tolist()}
    runs = []
    for ahead in (False, True):
        llm = LLM(tiny_checkpoint, device="cuda", dtype="bfloat16", max_running_requests=3)
        assert llm.runner.graphs.capture
        runs.append(_decode_steps(llm.runner, prompts, 12, params, ahead=ahead, extra=extra))
        assert llm.runner.graphs.steps == 11 and not llm.runner.unfinished
    assert runs[1] == runs[0]
