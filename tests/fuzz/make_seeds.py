#!/usr/bin/env python3
"""Writes the seed corpora of tests/fuzz/corpus/<target>/ from hand-made inputs and small files of
the repository (chat templates, configs). Run from the repository root after changing it; the
corpora are committed, along with the crash inputs the fuzzers found (named crash-*)."""
import json
import os
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(ROOT, "tests", "fuzz", "corpus")


def write(target, name, data):
    path = os.path.join(CORPUS, target, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogateescape")
    with open(path, "wb") as out:
        out.write(data)


def request_seeds():
    completions = [
        {"prompt": "Hi", "max_tokens": 8},
        {"prompt": "Once", "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
         "stop": ["\n", "END"], "seed": 7, "n": 2, "stream": True, "stream_options": {"include_usage": True}},
        {"prompt": [9707, 11, 847], "logprobs": 3, "echo": True, "max_tokens": 2},
        {"prompt": [[1, 2], [3, 4, 5]], "n": 3, "best_of": 3, "logit_bias": {}, "ignore_eos": True,
         "stop_token_ids": [0, 2], "skip_special_tokens": False, "repetition_penalty": 1.1,
         "presence_penalty": -0.5, "frequency_penalty": 2.0},
        {"prompt": ["a", "b", "c"], "model": "demo", "suffix": "", "max_tokens": 1.0},
    ]
    chats = [
        {"messages": [{"role": "user", "content": "Hello"}]},
        {"messages": [{"role": "system", "content": "Be terse."},
                      {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                      {"role": "tool", "content": "sunny", "tool_call_id": "c1"}],
         "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
         "chat_template_kwargs": {"enable_thinking": False}, "max_completion_tokens": 12, "logprobs": True,
         "top_logprobs": 2, "add_generation_prompt": True},
        {"messages": [{"role": "user", "content": "x", "reasoning_content": "why", "name": "u"}], "stream": True},
    ]
    for i, body in enumerate(completions):
        write("request", f"completion-{i}", b"\x00" + json.dumps(body).encode())
    for i, body in enumerate(chats):
        write("request", f"chat-{i}", b"\x01" + json.dumps(body).encode())
    write("request", "number-overflow", b'\x00{"prompt": "x", "max_tokens": 1e400}')
    write("request", "deep", b'\x01{"messages": [{"role": "user", "content": "x", "extra": ' + b"[" * 70 + b"]" * 70 + b"}]}")
    write("request", "malformed", b'\x00{"prompt": "x", ')
    write("request", "not-object", b"\x01[1, 2, 3]")
    write("request", "bad-utf8", b'\x00{"prompt": "\xff\xfe", "stop": "\xc3"}')


def responses_seeds():
    # Byte 0: bit 0 the Hermes tool-call parser, bits 1-3 the piece size; the body; NUL; generated text.
    tools = [{"type": "function", "name": "weather", "parameters": {"type": "object",
                                                                     "properties": {"city": {"type": "string"}}}}]
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    seeds = {
        "tool-call": (1, {"input": "Weather?", "tools": tools}, "Sure." + call + "\n" + call),
        "items": (6, {"input": [{"role": "user", "content": "q"},
                                {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "r"}]},
                                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                                {"type": "function_call_output", "call_id": "c", "output": "o"},
                                {"type": "message", "role": "assistant",
                                 "content": [{"type": "output_text", "text": "a", "annotations": []}]}],
                      "instructions": "I", "previous_response_id": "resp_1", "store": False},
                  "Let me think. The answer is 4."),
        "formats": (3, {"input": "x", "stream": True, "max_output_tokens": 5, "temperature": 0, "top_p": 0.5,
                        "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}},
                        "tool_choice": {"type": "function", "name": "weather"}, "tools": tools, "stop": ["\n"]},
                    '<tool_call>{"name": broken</tool_call> trailing'),
        "refused": (0, {"input": "x", "tools": [{"type": "web_search"}], "background": True}, ""),
    }
    for name, (options, body, text) in seeds.items():
        write("responses", name, bytes([options]) + json.dumps(body).encode() + b"\0" + text.encode())
    write("responses", "bad-utf8", b'\x0f{"input": "\xff\xfe"}\0\xc3(\xa0\xa1 text')


def safetensors_file(entries, data, pad=True, metadata=None):
    header = {}
    if metadata:
        header["__metadata__"] = metadata
    header.update(entries)
    text = json.dumps(header, separators=(",", ":"))
    if pad:
        text += " " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text.encode() + data


def safetensors_seeds():
    f32 = struct.pack("<4f", 1.0, -2.0, 0.5, 3.0)
    bf16 = struct.pack("<3H", 0x3F80, 0xC000, 0x4040)
    write("safetensors", "one-f32", safetensors_file({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, f32))
    write("safetensors", "mixed-unpadded", safetensors_file(
        {"b": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]},
         "a": {"dtype": "F32", "shape": [2], "data_offsets": [6, 14]},
         "e": {"dtype": "F32", "shape": [0, 4], "data_offsets": [14, 14]}}, bf16 + f32[:8], pad=False,
        metadata={"format": "pt"}))
    write("safetensors", "every-dtype", safetensors_file(
        {name: {"dtype": name, "shape": [1], "data_offsets": [8 * i, 8 * i + size]}
         for i, (name, size) in enumerate([("F64", 8), ("I64", 8), ("U64", 8), ("F32", 4), ("I32", 4), ("U32", 4),
                                           ("F16", 2), ("BF16", 2), ("I16", 2), ("U16", 2), ("F8_E4M3", 1),
                                           ("F8_E5M2", 1), ("I8", 1), ("U8", 1), ("BOOL", 1)])},
        b"".join(bytes(8) for _ in range(15))[:8 * 14 + 1]))
    write("safetensors", "overlap", safetensors_file(
        {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
         "b": {"dtype": "F32", "shape": [3], "data_offsets": [4, 16]}}, f32))
    write("safetensors", "scalar", safetensors_file({"s": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}, f32[:4]))
    write("safetensors", "truncated", b"\x10\x00\x00\x00\x00\x00\x00\x00{\"w\":")


def config_seeds():
    for name in sorted(os.listdir(os.path.join(ROOT, "configs"))):
        with open(os.path.join(ROOT, "configs", name), "rb") as f:
            write("config", name, f.read())
    with open(os.path.join(ROOT, "models", "demo", "config.json"), "rb") as f:
        write("config", "demo.json", f.read())
    write("config", "composite.json", json.dumps({
        "model_type": "qwen3_5", "tie_word_embeddings": True, "eos_token_id": [1, 2],
        "text_config": {"model_type": "qwen3_5_text", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                                         "attention_factor": 1.2, "truncate": False}}}))


def tiny_tokenizer(normalizer=None, pre_tokenizer=None, post_processor=None, added=()):
    byte_chars = []
    for b in list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100)):
        byte_chars.append((b, chr(b)))
    n = 0
    mapping = {}
    for b in range(256):
        if any(b == x for x, _ in byte_chars):
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + n)
            n += 1
    vocab = {mapping[b]: b for b in range(256)}
    merges = [["h", "e"], ["l", "l"], ["he", "ll"], ["hell", "o"], ["\u0120", "w"], ["o", "r"], ["\u0120w", "or"]]
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    added_tokens = [{"id": len(vocab) + i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                     "normalized": False, "special": True} for i, c in enumerate(added)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True}
    return json.dumps({"version": "1.0", "added_tokens": added_tokens, "normalizer": normalizer,
                       "pre_tokenizer": pre_tokenizer or byte_level, "post_processor": post_processor or byte_level,
                       "decoder": byte_level,
                       "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                                 "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                                 "ignore_merges": False, "vocab": vocab, "merges": merges}})


def tokenizer_seeds():
    text = "hello world <|end|> \u00e9\U0001F600 12345"
    config = json.dumps({"eos_token": "<|end|>", "bos_token": {"content": "<s>"}, "add_bos_token": False,
                         "chat_template": "{{ messages[0].content }}"})
    write("tokenizer", "byte-level", tiny_tokenizer(added=["<|end|>", "<s>"]) + "\0" + config + "\0" + text)
    write("tokenizer", "nfc-split", tiny_tokenizer(
        normalizer={"type": "NFC"},
        pre_tokenizer={"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
             "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        added=["<|end|>"]) + "\0\0" + text)
    write("tokenizer", "template-processing", tiny_tokenizer(
        post_processor={"type": "TemplateProcessing",
                        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                        "special_tokens": {"<s>": {"id": "<s>", "ids": [263], "tokens": ["<s>"]}}},
        added=["<s>"]) + "\0\0" + text)
    write("tokenizer", "bad", '{"model": {"type": "WordPiece"}}\0\0x')


def chat_template_seeds():
    directory = os.path.join(ROOT, "tests", "text", "chat_templates")
    for name in sorted(os.listdir(directory)):
        if name.endswith(".jinja"):
            with open(os.path.join(directory, name), "rb") as f:
                write("chat_template", name, f.read())
    write("chat_template", "features",
          "{% set ns = namespace(n=0) %}{% for m in messages if m.role != 'tool' %}{% set ns.n = ns.n + 1 %}"
          "{{ loop.index }}:{{ m.role | upper }} {{ m.content | trim }}{% if not loop.last %}\n{% endif %}{% endfor %}"
          "{% macro f(x, y=2) %}{{ x * y }}{{ kwargs }}{% endmacro %}{{ f(3) }}{{ f(1, y=5) }}"
          "{{ [1, 2, 3][1:] | tojson }}{{ {'a': 1} | items | list }}{{ 'a,b' .split(',') | join('-') }}"
          "{% if messages | selectattr('role', 'equalto', 'user') | list | length > 0 %}yes{% endif %}"
          "{{ range(3) | reverse | list }}{{ strftime_now('%Y') }}{% raw %}{{ raw }}{% endraw %}")
    write("chat_template", "messages", "{{ messages | tojson(indent=2) }}\0" + json.dumps(
        [{"role": "user", "content": "hi", "tool_calls": [{"function": {"name": "f", "arguments": {"b": 1, "1": 2}}}]}]))
    write("chat_template", "errors", "{{ raise_exception('no') }}")
    write("chat_template", "deep-value", "{% set ns = namespace(x=[]) %}{% for i in range(200) %}{% set ns.x = [ns.x] %}"
          "{% endfor %}{{ ns.x | length }}")


def reasoning_seeds():
    write("reasoning", "tags", b"\x00\x03\x05\x09\x20<think>\nstep one\nstep two</think>\n\nThe answer.")
    write("reasoning", "open", b"\x01\x02\x04\x0a still thinking </th")
    write("reasoning", "plain", b"\x00\x00Just content, no tags, <thin")
    write("reasoning", "partial", b"\x00\x05\x01\x02\x03\x04\x05  <thi")


def sse_seeds():
    write("sse", "plain", b"\x0f" + b"cmpl-1\0demo\0\x00Hello \xff world\0reason\nline\0stop\0\x02tok\0\xffalt\0\x05\x07")
    write("sse", "controls", b"\x3a" + b"id\0m\0\x01\x00\x01\x02\n\n\r\0\x7f\0length\0")


def main():
    request_seeds()
    responses_seeds()
    safetensors_seeds()
    config_seeds()
    tokenizer_seeds()
    chat_template_seeds()
    reasoning_seeds()
    sse_seeds()
    return 0


if __name__ == "__main__":
    sys.exit(main())
