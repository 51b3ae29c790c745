"""LoRA adapters against PEFT: two random adapters (one on every projection, one of another rank with rsLoRA on some)
and the base model served by one engine, requests of all three batched in the same steps; prompt logprobs within
1e-4 and greedy tokens equal to PEFT's merged model (transformers) for each; the prefix cache never hands one
adapter's blocks to another."""
from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest
from engine_helpers import exported
from serve_process import serve_in_thread

from octavo import LLM, SamplingParams
from octavo.errors import InvalidRequestError, ModelFormatError
from octavo.runtime.engine_args import EngineArgs

PROMPTS = [[5, 17, 42, 99, 7, 120, 33, 8, 250, 61, 19, 77, 3, 200, 150, 90, 11, 300, 45, 66],
           [300, 2, 9, 180, 44, 57, 230, 12, 81, 99], [15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28]]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base, path, rank: int, targets: list[str], seed: int, rslora: bool = False):  # noqa: ANN001, ANN201
    import peft
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False,
                             use_rslora=rslora, lora_dropout=0.0)
    pm = peft.get_peft_model(model, config)
    with torch.no_grad():  # B random too (PEFT's init leaves it at zero): the adapter changes every output
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    pm.save_pretrained(path)
    return path


def reference(base, adapter, prompts: list[list[int]], new: int):  # noqa: ANN001, ANN201
    """(log-softmax of every prompt position, greedy tokens) of the base model or PEFT's merged adapter."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            logits = model(torch.tensor([ids])).logits[0].double()
            lp = torch.log_softmax(logits, -1).numpy()
            gen = model.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
            out.append((lp, gen))
    return out


@pytest.fixture(scope="module")
def setup(hf_model_dir, tmp_path_factory):  # noqa: ANN001, ANN201
    base = hf_model_dir("llama")
    root = tmp_path_factory.mktemp("lora")
    one = make_adapter(base, root / "one", 4, ALL, seed=1)
    two = make_adapter(base, root / "two", 8, ["q_proj", "v_proj", "down_proj"], seed=2, rslora=True)
    refs = {name: reference(base, path, PROMPTS, 6) for name, path in (("base", None), ("one", one), ("two", two))}
    return exported(base), one, two, refs


def test_adapters_and_base_in_one_batch_match_peft(setup) -> None:  # noqa: ANN001
    model, one, two, refs = setup
    llm = LLM(str(model), lora_modules=f"one={one},two={two}", max_lora_rank=8, num_blocks=64, num_threads=1)
    try:
        engine = llm.engine
        kinds: list[set[int]] = []
        engine.add_step_listener(lambda rec: kinds.append({r.lora_slot for r in rec.scheduled}))
        for round_ in range(2):  # the second round finds the first's blocks in the prefix cache
            for name in ("base", "one", "two"):
                for i, ids in enumerate(PROMPTS):
                    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, output_kind="final_only",
                                            prompt_logprobs=0 if round_ == 0 else None,
                                            lora_name=None if name == "base" else name)
                    engine.add_request(f"{round_}-{name}-{i}", {"prompt_token_ids": ids}, params)
            done = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
            for name in ("base", "one", "two"):
                for i, ids in enumerate(PROMPTS):
                    out, (lp, greedy) = done[f"{round_}-{name}-{i}"], refs[name][i]
                    assert out.outputs[0].token_ids == greedy, (round_, name, i)
                    if round_ == 0:
                        got = [e[ids[p]].logprob for p, e in enumerate(out.prompt_logprobs) if e is not None]
                        want = [lp[p - 1, ids[p]] for p in range(1, len(ids))]
                        assert np.allclose(got, want, atol=1e-4), (name, i, np.abs(np.array(got) - want).max())
        assert any(k == {0, 1, 2} for k in kinds)  # a step with rows of the base and of both adapters
        assert engine.stats().prefix_cache_hits > 0 and engine.stats().num_free_blocks == engine.num_blocks
        # the adapters really change the output (else the comparison above would prove little)
        assert refs["one"][0][1] != refs["base"][0][1] or refs["two"][0][1] != refs["base"][0][1]
        with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'three'"):
            llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False, lora_request="three")
        out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                           use_tqdm=False, lora_request="two")
        assert out[0].outputs[0].token_ids == refs["two"][1][1]
    finally:
        llm.close()


def test_bad_lora_arguments(setup, tmp_path) -> None:  # noqa: ANN001
    model, one, two, _ = setup
    with pytest.raises(InvalidRequestError, match="rank 8"):
        LLM(str(model), lora_modules=f"two={two}", max_lora_rank=4, num_blocks=16, num_threads=1)
    with pytest.raises(InvalidRequestError, match="max_loras"):
        LLM(str(model), lora_modules=f"one={one},two={two}", max_loras=1, max_lora_rank=8, num_blocks=16,
            num_threads=1)
    with pytest.raises(ModelFormatError, match="PEFT LoRA folder"):
        LLM(str(model), lora_modules=f"x={tmp_path}", num_blocks=16, num_threads=1)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "use_dora": True}))
    (tmp_path / "adapter_model.safetensors").write_bytes((one / "adapter_model.safetensors").read_bytes())
    with pytest.raises(ModelFormatError, match="use_dora"):
        LLM(str(model), lora_modules=f"x={tmp_path}", num_blocks=16, num_threads=1)
    with pytest.raises(InvalidRequestError, match="name=path"):
        LLM(str(model), lora_modules="justapath", num_blocks=16, num_threads=1)


def test_served_adapters(setup) -> None:  # noqa: ANN001
    """The adapters are models of the server: listed in /v1/models with their base as parent, chosen by `model`
    on completions, chat, Responses and Messages; an unknown name is a 404."""
    model, one, two, refs = setup
    args = EngineArgs(model=str(model), lora_modules=f"one={one},two={two}", max_lora_rank=8, num_blocks=64,
                      num_threads=1)
    with serve_in_thread(args, served_model_names=("tiny",)) as s:
        listed = {m["id"]: m for m in httpx.get(s.base_url + "/v1/models").json()["data"]}
        assert set(listed) == {"tiny", "one", "two"} and listed["one"]["parent"] == "tiny"
        assert listed["one"]["root"] == str(one)
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0)
        for name in ("tiny", "one", "two"):
            c = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
            assert c.model == name
            assert c.choices[0].token_ids == refs["base" if name == "tiny" else name][0][1]
        r = client.responses.create(model="one", input="hello", max_output_tokens=3, temperature=0)
        assert r.model == "one"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="three", prompt="x", max_tokens=2)
        assert httpx.post(s.base_url + "/tokenize", json={"model": "one", "prompt": "hi"}).status_code == 200
        metrics = httpx.get(s.base_url + "/metrics").text
        assert "vllm:lora_requests_info" in metrics and 'max_lora="4"' in metrics


def test_runtime_load_and_unload(setup, tmp_path) -> None:  # noqa: ANN001
    """vLLM's load/unload routes (behind their flag): an adapter loaded at run time serves exactly as PEFT's; one
    loaded again under a name from another folder never reuses the first one's cached blocks."""
    model, one, two, refs = setup
    args = EngineArgs(model=str(model), enable_lora=True, max_loras=1, max_lora_rank=8, num_blocks=64, num_threads=1)
    with serve_in_thread(args, served_model_names=("tiny",), allow_runtime_lora_updating=True) as s:
        post = lambda path, body: httpx.post(s.base_url + path, json=body)  # noqa: E731
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0)

        def tokens(name: str) -> list[int]:
            c = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
            return c.choices[0].token_ids

        assert post("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(one)}).status_code == 200
        assert tokens("a") == refs["one"][0][1]
        r = post("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(two)})
        assert r.status_code == 400 and "slots" in r.json()["error"]["message"]  # max_loras 1
        assert post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)}).status_code == 400
        assert post("/v1/unload_lora_adapter", {"lora_name": "a"}).status_code == 200
        assert post("/v1/unload_lora_adapter", {"lora_name": "a"}).status_code == 404
        assert post("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(two)}).status_code == 200
        assert tokens("a") == refs["two"][0][1]  # same name, other weights: the old blocks are not reused
        assert {m["id"] for m in httpx.get(s.base_url + "/v1/models").json()["data"]} == {"tiny", "a"}
    with serve_in_thread(args, served_model_names=("tiny",)) as s:  # without the flag: no such routes
        assert httpx.post(s.base_url + "/v1/load_lora_adapter", json={}).status_code == 404
