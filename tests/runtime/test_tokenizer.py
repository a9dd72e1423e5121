"""Tokenizers from a local tokenizer.json (a BPE trained here), chat templates, and real token counts over HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from tokenizers import decoders as tok_decoders

from coral.errors import CoralError
from coral.runtime.deploy.cluster_config import parse_cluster
from coral.runtime.deploy.deployment import Deployment
from coral.runtime.serving.tokenizer import ByteTokenizer, HfTokenizer, load_tokenizer

from .conftest import http, sse

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a serving engine batches forward passes and pages its KV cache",
    "prefill and decode run on different instances",
    "héllo wörld, ünïcode text survives the round trip",
] * 20

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"


@pytest.fixture
def tok_dir(tmp_path: Path) -> Path:
    """A byte-level BPE of ~300 tokens trained on a small corpus, saved as HF stores it."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tok_decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|im_end|>", "bos_token": "<s>"}))
    return tmp_path


def test_encode_decode_round_trip_and_merges(tok_dir: Path) -> None:
    tok = HfTokenizer(tok_dir)
    text = "the quick brown fox, héllo wörld"
    ids = tok.encode(text)
    assert text == tok.decode(ids)
    assert len(ids) < len(text.encode())  # merges learned: fewer tokens than bytes
    assert tok.vocab_size <= 300 and all(0 <= i < tok.vocab_size for i in ids)
    assert (tok._tok.token_to_id("<|im_end|>"),) == tok.eos_ids


def test_chat_template_from_tokenizer_config(tok_dir: Path) -> None:
    tok = HfTokenizer(tok_dir)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    want = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert want == tok.chat_prompt(msgs)
    ids = tok.encode(tok.chat_prompt(msgs), add_special_tokens=False)
    start = tok._tok.token_to_id("<|im_start|>")
    assert start == ids[0] and 3 == ids.count(start)  # special tokens in the template are single ids
    override = HfTokenizer(tok_dir, chat_template="{{ messages[-1]['content'] }}!")
    assert "hi!" == override.chat_prompt(msgs)


def test_byte_tokenizer_keeps_the_builtin_template(tok_dir: Path) -> None:
    """The byte tokenizer's template and an HF tokenizer's built-in fallback render alike."""
    from coral.runtime.serving.models import ChatMessage

    msgs = [ChatMessage(role="user", content="hi"), ChatMessage(role="assistant", content="yo")]
    want = "<|user|>\nhi\n<|assistant|>\nyo\n<|assistant|>\n"
    assert want == ByteTokenizer().chat_prompt(msgs)
    (tok_dir / "tokenizer_config.json").unlink()
    assert want == HfTokenizer(tok_dir).chat_prompt(msgs)
    assert want.removesuffix("<|assistant|>\n") == HfTokenizer(tok_dir).chat_prompt(msgs, add_generation_prompt=False)
    s = ByteTokenizer().stream()
    euro = "€".encode()
    assert "" == s.push(list(euro[:2])) and "€" == s.push(list(euro[2:])) and "" == s.flush()


def test_streamed_text_holds_back_partial_characters(tok_dir: Path) -> None:
    tok = HfTokenizer(tok_dir)
    ids = tok.encode("wörld ünïcode")
    s = tok.stream()
    pieces = [s.push([i]) for i in ids] + [s.flush()]
    assert "wörld ünïcode" == "".join(pieces)
    assert all("\ufffd" not in p for p in pieces)


def test_bad_tokenizers_fail_at_load(tok_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(CoralError, match="no tokenizer.json at"):
        load_tokenizer(str(tmp_path / "nope"), None, 512, "m")
    with pytest.raises(CoralError, match="its tokenizer has .* tokens but the model's vocab_size is 100"):
        load_tokenizer(str(tok_dir), None, 100, "m")
    with pytest.raises(CoralError, match="chat_template needs a tokenizer"):
        load_tokenizer(None, "{{ x }}", 512, "m")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(CoralError, match="not a tokenizers file"):
        load_tokenizer(str(tmp_path / "bad.json"), None, 512, "m")
    cluster = {
        "models": [{"name": "t", "builtin": "tiny-llama", "tokenizer": str(tmp_path / "nope")}],
        "instances": [{"name": "i", "model": "t", "stages": [{"layers": [0, 6]}]}],
    }
    with pytest.raises(CoralError, match="no tokenizer.json"):
        parse_cluster(cluster)


def test_served_text_uses_the_model_tokenizer(tok_dir: Path) -> None:
    """coral serve with a tokenizer: usage counts its tokens, the text is its decoding of token_ids."""
    spec = parse_cluster({
        "coordinator": {"port": 0}, "device": "cpu",
        "models": [{"name": "t", "builtin": "tiny-llama", "tokenizer": str(tok_dir / "tokenizer.json")}],
        "instances": [{"name": "i", "model": "t", "stages": [{"layers": [0, 6]}]}],
    })  # fmt: skip
    tok = HfTokenizer(tok_dir)
    dep = Deployment(spec, http_port=0)
    dep.start(timeout_s=120)
    try:
        prompt = "the lazy dog"
        status, body = http("POST", dep.url + "/v1/completions", {"model": "t", "prompt": prompt, "max_tokens": 6, "temperature": 0})
        assert 200 == status, body
        choice = body["choices"][0]
        assert len(tok.encode(prompt)) == body["usage"]["prompt_tokens"]
        assert tok.decode(choice["token_ids"]) == choice["text"]
        msgs = [{"role": "user", "content": "hi"}]
        status, body = http("POST", dep.url + "/v1/chat/completions", {"model": "t", "messages": msgs, "max_tokens": 4, "temperature": 0})
        assert 200 == status, body
        assert len(tok.encode(tok.chat_prompt(msgs), add_special_tokens=False)) == body["usage"]["prompt_tokens"]
        events = sse(dep.url + "/v1/completions", {"model": "t", "prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": True})
        chunks = [e for _, e in events if isinstance(e, dict)]
        streamed = [t for c in chunks for t in c["choices"][0]["token_ids"]]
        assert tok.decode(streamed) == "".join(c["choices"][0]["text"] for c in chunks)
    finally:
        dep.stop()
