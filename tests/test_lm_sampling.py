"""`CompiledLM.generate` called as `model.generate` is (issue 34 part 3): sampling with the same seed draws the
same tokens, eos and its explicit `None`, `min_new_tokens`, stop strings, streamers and generation configs mean
what they mean to transformers, in process and after save + load.

One tiny Llama (tests/test_lm.py's, vocab 96) compiled once for a batch of 2 and saved and loaded once; its
generation config's eos is the first token its greedy continuation of the first prompt reaches at the fourth new
token or later without having chosen it before (`STOP`), so that stopping at eos (and running past it) is exercised.
"""

from __future__ import annotations

import copy
import json
import string

import attrs
import pytest
import torch

import fx_rewrites
from fx_rewrites.app.lm import LMInfo
from tests.test_lm import prompts, tiny_llama

NEW = 24
CACHE = 40
PROMPT = 7
SEEDS = range(5)
#: one option of each kind, strong enough to change the draws (checked: the five seeds do not all agree)
OPTIONS = {
    "temperature": {"temperature": 0.7},
    "top_k": {"top_k": 8},
    "top_p": {"top_p": 0.8},
    "repetition_penalty": {"repetition_penalty": 1.5},
}


@pytest.fixture(scope="module")
def model():
    llama = tiny_llama()
    ids, mask = prompts(2)
    free = llama.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    new = free[0, PROMPT:].tolist()
    stop = next(i for i in range(3, NEW) if new[i] not in new[:i])
    llama.generation_config.eos_token_id = new[stop]  # row 0's greedy continuation ends with its (stop+1)th token
    llama.stop = stop + 1
    return llama


@pytest.fixture(scope="module")
def compiled(model):
    return fx_rewrites.compile_lm(model, max_cache_len=CACHE, batch_size=2)


@pytest.fixture(scope="module")
def loaded(compiled, tmp_path_factory):
    path = tmp_path_factory.mktemp("lm") / "lm.vmfb"
    compiled.save(path)
    return fx_rewrites.load(path)


@pytest.fixture(params=["compiled", "loaded"])
def lm(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(autouse=True)
def one_thread():
    """torch on one thread while a test runs (restored after): transformers' loop runs a few tiny ops a step,
    which torch's thread pool slows tenfold on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tokenizer():
    """A character-level tokenizer over the tiny model's 96 ids (no download): pad, bos, eos, then 93 printable
    characters, decoded by concatenation."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = (string.ascii_letters + string.digits + string.punctuation)[:93]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def seeded(generate, seed: int, *args, **kwargs):
    torch.manual_seed(seed)
    return generate(*args, **kwargs)


@pytest.mark.parametrize("option", OPTIONS)
def test_sampling_draws_the_tokens_generate_draws(model, compiled, loaded, option):
    for batch in (1, 2):
        ids, mask = prompts(batch, seed=batch)
        kwargs = {"attention_mask": mask, "max_new_tokens": NEW, "do_sample": True, **OPTIONS[option]}
        wants = []
        for seed in SEEDS:
            want = seeded(model.generate, seed, ids, **kwargs)
            for name, lm in (("in process", compiled), ("loaded", loaded)):
                got = seeded(lm.generate, seed, ids, **kwargs)
                assert torch.equal(got, want), f"{option}, batch {batch}, seed {seed}, {name}:\n{got}\n!=\n{want}"
            wants.append(tuple(want.flatten().tolist()))
        assert len(set(wants)) >= 3, "the seeds drew the same tokens: the test would not see a wrong draw"


def test_eos_left_out_stops_and_explicit_none_runs_past_it(model, lm):
    ids, mask = prompts(2)
    one = ids[:1]
    eos = model.generation_config.eos_token_id
    stopped = model.generate(one, max_new_tokens=NEW)
    assert stopped.shape[1] == PROMPT + model.stop and stopped[0, -1] == eos
    assert torch.equal(lm.generate(one, max_new_tokens=NEW), stopped)
    # an explicit None turns the stop off, in transformers as here: exactly NEW tokens, eos among them
    free = model.generate(one, max_new_tokens=NEW, eos_token_id=None)
    assert free.shape[1] == PROMPT + NEW and eos in free[0, PROMPT:].tolist()
    assert torch.equal(lm.generate(one, max_new_tokens=NEW, eos_token_id=None), free)
    # a GenerationConfig whose eos is None takes the model's (None is "not set" there)
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=NEW, eos_token_id=None)
    assert torch.equal(lm.generate(one, generation_config=config), model.generate(one, generation_config=config))
    assert lm.generate(one, generation_config=config).shape == stopped.shape
    # batch 2: row 0 ends and is padded after eos while row 1 goes on; with None neither stops
    kwargs = {"attention_mask": mask, "max_new_tokens": NEW}
    padded = model.generate(ids, **kwargs)
    assert (padded[0, PROMPT + model.stop :] == model.generation_config.pad_token_id).all()
    assert torch.equal(lm.generate(ids, **kwargs), padded)
    assert torch.equal(lm.generate(ids, **kwargs, eos_token_id=None), model.generate(ids, **kwargs, eos_token_id=None))


def test_min_new_tokens_holds_eos_back(model, lm):
    one = prompts(1)[0]
    want = model.generate(one, max_new_tokens=NEW, min_new_tokens=model.stop + 2)
    assert want.shape[1] > PROMPT + model.stop  # eos was held back
    assert torch.equal(lm.generate(one, max_new_tokens=NEW, min_new_tokens=model.stop + 2), want)
    kwargs = {"max_new_tokens": NEW, "min_new_tokens": 6, "do_sample": True, "top_k": 4}
    for seed in SEEDS:
        assert torch.equal(seeded(lm.generate, seed, one, **kwargs), seeded(model.generate, seed, one, **kwargs))


def test_a_streamer_gets_each_token_before_the_next_step(model, compiled):
    """The streamer's `put` of each token comes before the module call that consumes it: tokens as they come."""
    from transformers.generation import BaseStreamer

    log: list[tuple[str, list[int]]] = []

    class Recorder(BaseStreamer):
        def put(self, value):
            log.append(("put", value.flatten().tolist()))

        def end(self):
            log.append(("end", []))

    def logged(name, function):
        def call(*args):
            log.append((name, args[0].flatten().tolist()))  # the tokens this call reads
            return function(*args)

        return call

    module = copy.copy(compiled.module)
    module.functions = {name: logged(name, f) for name, f in compiled.module.functions.items()}
    lm = attrs.evolve(compiled, module=module)
    ids = prompts(1)[0]
    out = lm.generate(ids, max_new_tokens=6, eos_token_id=None, streamer=Recorder())
    new = out[0, PROMPT:].tolist()
    want = [("put", ids[0].tolist()), ("prefill", ids[0].tolist() + [0] * PROMPT)]
    for i, token in enumerate(new):
        want.append(("put", [token]))
        if i < len(new) - 1:
            want.append(("decode", [token, 0]))  # the filler row's token: the module is compiled for 2
    assert log == [*want, ("end", [])]
    assert torch.equal(out, model.generate(ids, max_new_tokens=6, eos_token_id=None))


def test_text_streamer_and_stop_strings(model, lm, capsys):
    from transformers import TextStreamer

    tok = tokenizer()
    one = prompts(1)[0]
    free = model.generate(one, max_new_tokens=NEW, eos_token_id=None)
    stop = tok.decode(free[0, PROMPT + 5 : PROMPT + 7])
    want = model.generate(one, max_new_tokens=NEW, eos_token_id=None, stop_strings=stop, tokenizer=tok)
    assert want.shape[1] == PROMPT + 7
    got = lm.generate(one, max_new_tokens=NEW, eos_token_id=None, stop_strings=stop, tokenizer=tok)
    assert torch.equal(got, want)
    capsys.readouterr()
    lm.generate(one, max_new_tokens=10, eos_token_id=None, streamer=TextStreamer(tok, skip_prompt=True))
    assert capsys.readouterr().out == tok.decode(free[0, PROMPT : PROMPT + 10]) + "\n"
    with pytest.raises(ValueError, match="tokenizer"):  # transformers' own error
        lm.generate(one, max_new_tokens=4, stop_strings=stop)


def test_the_models_generation_config_is_saved_and_drives_generate(model, compiled, loaded):
    from transformers import GenerationConfig

    for lm in (compiled, loaded):
        saved = GenerationConfig.from_dict(json.loads(lm.info.generation_config))
        assert saved.to_diff_dict() == model.generation_config.to_diff_dict()
    # a model that samples by default (as instruct models' configs say): generate() with no options samples alike
    sampler = copy.deepcopy(model)
    sampler.generation_config.update(do_sample=True, top_k=6, temperature=0.8, max_new_tokens=12)
    info = attrs.evolve(loaded.info, generation_config=json.dumps(sampler.generation_config.to_diff_dict()))
    lm = attrs.evolve(loaded, info=info)
    ids, mask = prompts(2)
    for seed in SEEDS:
        want = seeded(sampler.generate, seed, ids, attention_mask=mask)
        assert torch.equal(seeded(lm.generate, seed, ids, attention_mask=mask), want)


def test_a_file_saved_before_the_generation_config_still_generates(model, compiled):
    """An `LMInfo` JSON without the generation config (files saved before it was kept) reads; its pad and eos
    stand for the model's generation config."""
    doc = json.loads(compiled.info.to_json())
    for key in ("generation_config", "max_position_embeddings", "vocab_size"):
        del doc[key]
    info = LMInfo.from_json(json.dumps(doc))
    assert info.generation_config == "" and info.eos_token_id == (model.generation_config.eos_token_id,)
    lm = attrs.evolve(compiled, info=info)
    ids, mask = prompts(2)
    assert torch.equal(
        lm.generate(ids, attention_mask=mask, max_new_tokens=NEW),
        model.generate(ids, attention_mask=mask, max_new_tokens=NEW),
    )


def test_more_options_mean_what_they_mean_to_transformers(model, lm):
    one = prompts(1)[0]
    # num_return_sequences: the prompt repeated, each row drawn on its own
    kwargs = {"max_new_tokens": NEW, "do_sample": True, "num_return_sequences": 2, "eos_token_id": None}
    for seed in SEEDS[:2]:
        assert torch.equal(seeded(lm.generate, seed, one, **kwargs), seeded(model.generate, seed, one, **kwargs))
    # no max_new_tokens: transformers' default length (20 new tokens) with its warning
    with pytest.warns(UserWarning, match="max_length"):
        got = lm.generate(one, eos_token_id=None)
    assert torch.equal(got, model.generate(one, eos_token_id=None))
    # scores and logits, as model.generate returns them
    kwargs = {"max_new_tokens": 8, "return_dict_in_generate": True, "output_scores": True, "output_logits": True}
    got = seeded(lm.generate, 0, one, do_sample=True, top_k=5, **kwargs)
    want = seeded(model.generate, 0, one, do_sample=True, top_k=5, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for mine, theirs in ((got.scores, want.scores), (got.logits, want.logits)):
        assert len(mine) == len(theirs) == 8
        for a, b in zip(mine, theirs, strict=True):
            finite = torch.isfinite(b)
            assert torch.equal(torch.isfinite(a), finite)  # top-k: the same tokens masked
            torch.testing.assert_close(a[finite], b[finite], rtol=1e-4, atol=1e-4)


def test_errors_say_what_to_change(lm):
    ids, _ = prompts(2)
    with pytest.raises(NotImplementedError, match="num_beams=1"):
        lm.generate(ids, max_new_tokens=4, num_beams=2)
    with pytest.raises(TypeError, match="use_kv"):
        lm.generate(ids, max_new_tokens=4, use_kv=True)
    with pytest.raises(ValueError, match="batch_size=3"):
        lm.generate(torch.cat([ids, ids[:1]]), max_new_tokens=4)
    with pytest.raises(ValueError, match="batch_size=4"):
        lm.generate(ids, max_new_tokens=4, do_sample=True, num_return_sequences=2)
    with pytest.raises(ValueError, match="cache positions"):
        lm.generate(ids, max_new_tokens=CACHE)
