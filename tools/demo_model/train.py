#!/usr/bin/env python3
"""Trains metrale's demo model: a small qwen3_5 hybrid (Gated DeltaNet + gated attention) with an MTP head.

Run it on the GPU machine through tools/device/train_demo.sh (see tools/demo_model/README.md). Everything it makes
goes into --out, eight files (the device returns at most eight):

    config.json, generation_config.json, model.safetensors   the model, as a Qwen3.5 checkpoint (bf16)
    tokenizer.json, tokenizer_config.json                    byte-level BPE, 8,192 tokens, ChatML template
    heldout.txt                                              held-out evaluation text for `metrale score`
    reference_logits.npy                                     transformers' fp32 logits of a held-out snippet
    train_log.json                                           corpus, licences, training record, metrics, references

Steps:

1. Corpus (before torch is imported). Python source: every .py file of the standard library of the running
   interpreter (sysconfig "stdlib", PSF-2.0), minus tests, encodings tables and site-packages. English
   documentation: for every installed distribution whose METADATA declares a permissive licence (SPDX
   License-Expression, else license classifiers, else a short License field; see `package_licence`), its long
   description, its .md/.rst files and the docstrings (ast) of its .py files, vendored folders excluded. Docstrings
   are de-duplicated across the corpus. A document is one file. Order is sorted paths; sizes are capped
   per package and in total (water-filling, so small packages are kept whole). A document is held out when
   sha1(its id) mod 1000 < --heldout-permille (a split by file, independent of the seed).
2. Tokenizer (`tokenizers`): byte-level BPE over NFC-normalised text, pre-tokenised by Qwen2's split regex then
   ByteLevel (use_regex false), ByteLevel decoder and post-processor; trained on a seed-shuffled sample of the
   training documents to 8,190 tokens including <|endoftext|> (0), <|im_start|> (1), <|im_end|> (2), then
   <think> and </think> are added as non-special tokens (8190, 8191), as in Qwen3. Exactly 8,192 tokens.
3. Model: transformers `Qwen3_5ForCausalLM` (model_type qwen3_5_text), layer_types linear_attention x3 +
   full_attention, repeated; tied embeddings; see `build_config`. MTP head (`MtpHead`): the Qwen3.5 / Qwen3-Next
   layout, one full-attention `Qwen3_5DecoderLayer`; trained jointly, loss = CE(main) + --mtp-weight * CE(mtp).
   MTP math, per position t of the trunk (h_t = the trunk's final *normed* hidden state, what the LM head reads):
       u_t = fc( concat( pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t) ) )   embedding FIRST
       d_t = norm( DecoderLayer(u_t) )           causal attention over u_0..u_t, RoPE positions t
       p(x_{t+2}) = softmax( lm_head(d_t) )      lm_head = embed_tokens (tied)
   All norms are the zero-centred Qwen3_5RMSNorm (y = x / rms(x) * (1 + w)).
4. Training: documents joined by <|endoftext|> into one token stream; each step takes --batch-tokens tokens as
   windows at seed-drawn random offsets (--seq-len; the last --long-frac of the steps, and steps 25-29 which
   time it, at --long-seq-len); bf16 autocast, AdamW (0.9, 0.95, wd 0.1 on matrices), linear warm-up then cosine
   to 10%, clip 1.0. Training stops after the planned steps, planned from the step times measured on steps 5-29
   so that it ends within --time-budget seconds (or exactly --steps when given: pass the recorded
   `steps_planned` to repeat a run, up to GPU non-determinism that torch.use_deterministic_algorithms does not
   remove). The wall clock stops training early if the plan was too optimistic.
5. Saving: parameters rounded to bf16 (buffers such as the rotary inv_freq stay fp32), `save_pretrained`, then the
   `mtp.*` tensors are added to model.safetensors; config.json gets mtp_num_hidden_layers 1 and
   mtp_use_dedicated_embeddings false, as Qwen3.5 configs have.
6. Evaluation with the bf16-rounded weights, fp32 math: held-out loss and perplexity (--seq-len windows), MTP
   loss, top-1 accuracy against the true token after next, and agreement of the MTP argmax with the trunk's argmax
   one step later (the greedy acceptance rate of one draft).
7. References, on the CPU in fp32 from the saved directory (`from_pretrained(dtype=float32)`, eager attention):
   logits of a 64-token held-out snippet (reference_logits.npy [64, 8192] <f4; ids in train_log.json
   "reference"), and the perplexity of heldout.txt computed exactly as `metrale score --text` does: the whole text
   tokenized with add_special_tokens (this tokenizer adds nothing), one sequence, one forward, mean NLL of tokens
   1..T-1 (train_log.json "heldout_eval").
"""

import argparse
import ast
import copy
import hashlib
import json
import math
import multiprocessing
import os
import re
import sys
import sysconfig
import time
import traceback
from importlib import metadata as importlib_metadata
from pathlib import Path

# cuBLAS needs this before CUDA starts for torch.use_deterministic_algorithms.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK_TOKENS = ["<think>", "</think>"]
VOCAB_SIZE = 8192
# Qwen2/Qwen3's pre-tokenizer split: contractions, letter runs with one leading non-letter, single digits,
# punctuation runs, newline runs and whitespace.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

START_TIME = time.time()


def log(*parts):
    print(f"[{time.time() - START_TIME:7.1f}s]", *parts, flush=True)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output folder (created)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--time-budget", type=float, default=360.0, help="seconds of training (wall clock)")
    ap.add_argument("--total-budget", type=float, default=555.0,
                    help="seconds for the whole script; training is shortened to fit")
    ap.add_argument("--steps", type=int, default=0, help="planned steps (0: plan from the measured step time)")
    # corpus
    ap.add_argument("--stdlib-bytes", type=float, default=40e6, help="cap on standard-library source")
    ap.add_argument("--docs-bytes", type=float, default=40e6, help="cap on package documentation")
    ap.add_argument("--docs-per-package-bytes", type=float, default=3e6, help="extraction cap per package")
    ap.add_argument("--max-doc-bytes", type=int, default=300_000, help="longer documents are cut at a line end")
    ap.add_argument("--heldout-permille", type=int, default=20)
    ap.add_argument("--tokenizer-bytes", type=float, default=30e6, help="text the BPE trainer sees")
    # model
    ap.add_argument("--hidden", type=int, default=320)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=896)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--linear-key-heads", type=int, default=2)
    ap.add_argument("--linear-value-heads", type=int, default=4)
    ap.add_argument("--linear-head-dim", type=int, default=64)
    ap.add_argument("--rope-theta", type=float, default=1e6)
    ap.add_argument("--max-position", type=int, default=8192)
    # training
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--long-seq-len", type=int, default=2048)
    ap.add_argument("--long-frac", type=float, default=0.1, help="share of the steps at --long-seq-len")
    ap.add_argument("--batch-tokens", type=int, default=65536)
    ap.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--eval-windows", type=int, default=256, help="held-out windows in the final evaluation")
    ap.add_argument("--heldout-text-bytes", type=int, nargs=2, default=[18_000, 26_000],
                    help="min and max size of heldout.txt")
    ap.add_argument("--snippet-tokens", type=int, default=64)
    return ap.parse_args()


# ------------------------------------------------------------------------------------------------------------
# Corpus

PERMISSIVE_SPDX = {
    "MIT", "MIT-0", "BSD-2-Clause", "BSD-3-Clause", "BSD-3-Clause-Clear", "Apache-2.0", "PSF-2.0", "Python-2.0",
    "ISC", "Zlib", "0BSD", "Unlicense", "CC0-1.0", "HPND", "MIT-CMU", "BSL-1.0", "NCSA",
}
# SPDX exceptions that only add permissions.
PERMISSIVE_EXCEPTIONS = {"LLVM-exception"}
PERMISSIVE_CLASSIFIERS = {
    "License :: OSI Approved :: MIT License": "MIT",
    "License :: OSI Approved :: MIT No Attribution License (MIT-0)": "MIT-0",
    "License :: OSI Approved :: BSD License": "BSD",
    "License :: OSI Approved :: Apache Software License": "Apache-2.0",
    "License :: OSI Approved :: Python Software Foundation License": "PSF-2.0",
    "License :: OSI Approved :: ISC License (ISCL)": "ISC",
    "License :: OSI Approved :: zlib/libpng License": "Zlib",
    "License :: OSI Approved :: The Unlicense (Unlicense)": "Unlicense",
    "License :: OSI Approved :: Boost Software License 1.0 (BSL-1.0)": "BSL-1.0",
    "License :: CC0 1.0 Universal (CC0 1.0) Public Domain Dedication": "CC0-1.0",
}
# Classifiers that say nothing about which licence.
NEUTRAL_CLASSIFIERS = {"License :: OSI Approved", "License :: DFSG approved"}
SHORT_LICENCE_NAMES = [
    (r"^(the )?mit( license)?$", "MIT"),
    (r"^(new |modified |revised |simplified )?bsd( license)?$", "BSD"),
    (r"^bsd[- ]?[23][- ]?clause( license)?$", "BSD"),
    (r"^[23][- ]clause bsd( license)?$", "BSD"),
    (r"^apache( software)?( license)?,?( version)?[- ]?2(\.0)?( license)?$", "Apache-2.0"),
    (r"^apache software license$", "Apache-2.0"),
    (r"^(psf|python software foundation)( license)?$", "PSF-2.0"),
    (r"^isc( license)?$", "ISC"),
]
# Folders inside packages that hold vendored third-party code (other licences) or tests.
EXCLUDED_PACKAGE_DIRS = {
    "_vendor", "vendor", "vendored", "_vendored", "third_party", "thirdparty", "externals", "_externals",
    "extern", "_extern", "tests", "test", "testing", "_testing", "__pycache__",
}
EXCLUDED_STDLIB_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings",
                        "__pycache__", "_bundled", "lib2to3"}
LICENCE_FILE = re.compile(r"^(licen[cs]e|copying|notice|authors|changelog|changes|history|news|third[-_]party)",
                          re.IGNORECASE)


def spdx_is_permissive(expression):
    """Whether an SPDX expression allows permissive use: some OR-alternative whose AND-terms are all permissive."""
    text = expression.replace("(", " ").replace(")", " ")
    for alternative in re.split(r"\s+OR\s+", text):
        terms = re.split(r"\s+AND\s+", alternative.strip())
        ok = True
        for term in terms:
            licence, _, exception = term.strip().partition(" WITH ")
            licence = licence.strip().rstrip("+")
            if licence not in PERMISSIVE_SPDX or (exception and exception.strip() not in PERMISSIVE_EXCEPTIONS):
                ok = False
        if ok and terms:
            return True
    return False


def package_licence(meta):
    """(licence, permissive) from a distribution's METADATA: License-Expression, else classifiers, else License."""
    expression = meta.get("License-Expression")
    if expression:
        return expression.strip(), spdx_is_permissive(expression.strip())
    classifiers = [c.strip() for c in (meta.get_all("Classifier") or []) if c.strip().startswith("License ::")]
    classifiers = [c for c in classifiers if c not in NEUTRAL_CLASSIFIERS]
    if classifiers:
        names = [PERMISSIVE_CLASSIFIERS.get(c) for c in classifiers]
        if all(names):
            return " AND ".join(sorted(set(names))), True
        return "; ".join(classifiers), False
    field = (meta.get("License") or "").strip()
    if not field or field.upper() in {"UNKNOWN", "NONE"}:
        return "unknown", False
    if spdx_is_permissive(field):  # an SPDX expression in the License field (older PEP 639 tooling)
        return field, True
    first_line = field.splitlines()[0].strip().lower()
    for pattern, name in SHORT_LICENCE_NAMES:
        if re.match(pattern, first_line):
            return name, True
    lowered = field.lower()
    if "gnu" in lowered or "mozilla" in lowered or "general public" in lowered:
        return field.splitlines()[0][:80], False
    if "permission is hereby granted, free of charge" in lowered:
        return "MIT (licence text)", True
    if "redistribution and use in source and binary forms" in lowered:
        return "BSD (licence text)", True
    if "apache license" in lowered and "version 2.0" in lowered:
        return "Apache-2.0 (licence text)", True
    return field.splitlines()[0][:80], False


def cut_document(text, max_bytes):
    """Cuts a document to at most max_bytes of UTF-8, at a line end."""
    if len(text.encode("utf-8")) <= max_bytes:
        return text
    cut = text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")
    newline = cut.rfind("\n")
    return cut[: newline + 1] if newline > 0 else cut


def is_mostly_text(text):
    """Rejects binary-ish or non-English-heavy strings: at least 95% printable ASCII or whitespace."""
    if not text:
        return False
    ascii_count = sum(1 for ch in text if 32 <= ord(ch) < 127 or ch in "\n\t")
    return ascii_count >= 0.95 * len(text)


def read_text(path):
    """A file's text, or None when it is not UTF-8 or holds one of the tokenizer's special-token strings (these
    would be encoded as the special tokens themselves)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    if any(token in text for token in SPECIAL_TOKENS + THINK_TOKENS):
        return None
    return text


def docstrings_of(source):
    """Module, class and function docstrings of a Python source, in source order (cleaned by ast)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= 40 and is_mostly_text(doc):
                found.append((getattr(node, "lineno", 0), doc))
    found.sort(key=lambda item: item[0])
    return [doc for _, doc in found]


def stdlib_documents(max_doc_bytes):
    """[(doc_id, text)] of the standard library's .py files, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    documents = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if any(part in EXCLUDED_STDLIB_DIRS for part in relative.parts[:-1]):
            continue
        text = read_text(path)
        if not text or len(text) < 200:
            continue
        documents.append((f"stdlib:{relative.as_posix()}", cut_document(text, max_doc_bytes)))
    return root, documents


def package_documents(task):
    """Documentation of one distribution: [(doc_id, text, kind)], extraction stops at the per-package cap."""
    name, cap, max_doc_bytes = task
    dist = importlib_metadata.distribution(name)
    documents = []
    total = 0
    body = (dist.read_text("METADATA") or "").split("\n\n", 1)
    if (len(body) == 2 and len(body[1].strip()) >= 500 and is_mostly_text(body[1])
            and not any(token in body[1] for token in SPECIAL_TOKENS + THINK_TOKENS)):
        text = cut_document(body[1].strip() + "\n", max_doc_bytes)
        documents.append((f"pkg:{name}:METADATA", text, "description"))
        total += len(text)
    files = sorted(str(f) for f in (dist.files or []))
    for relative in files:
        if total >= cap:
            break
        parts = Path(relative).parts
        if any(part in EXCLUDED_PACKAGE_DIRS for part in parts[:-1]) or ".." in parts:
            continue
        if any(part.endswith((".dist-info", ".egg-info")) for part in parts[:-1]):
            continue
        suffix = Path(relative).suffix.lower()
        if suffix not in (".py", ".md", ".rst"):
            continue
        path = dist.locate_file(relative)
        try:
            size = os.path.getsize(path)
        except OSError:
            continue
        if size > 5_000_000:
            continue
        text = read_text(path)
        if not text:
            continue
        if suffix == ".py":
            docs = docstrings_of(text)
            if not docs:
                continue
            text = "\n\n".join(docs) + "\n"
            kind = "docstrings"
        else:
            if LICENCE_FILE.match(Path(relative).name) or not is_mostly_text(text):
                continue
            kind = "docs"
        if len(text) < 200:
            continue
        text = cut_document(text, max_doc_bytes)
        documents.append((f"pkg:{name}:{relative}", text, kind))
        total += len(text)
    return name, documents


def water_fill(sizes, cap):
    """The per-item limit L with sum(min(size, L)) <= cap (all of it when the sizes fit)."""
    if sum(sizes) <= cap:
        return max(sizes, default=0)
    low, high = 0, max(sizes)
    while low < high:
        mid = (low + high + 1) // 2
        if sum(min(s, mid) for s in sizes) <= cap:
            low = mid
        else:
            high = mid - 1
    return low


def drop_seen_paragraphs(text, seen):
    """Drops paragraphs (blank-line separated blocks) of at least 120 characters seen before; updates `seen`.
    Docstrings repeat a lot (copied methods, shared parameter blocks)."""
    kept = []
    for block in text.split("\n\n"):
        key = hashlib.sha1(block.strip().encode("utf-8")).digest()
        if len(block) >= 120 and key in seen:
            continue
        seen.add(key)
        kept.append(block)
    return "\n\n".join(kept)


def build_corpus(args):
    """Documents [(doc_id, text, source, kind)], and the list of sources with their licences."""
    stdlib_root, stdlib_docs = stdlib_documents(args.max_doc_bytes)
    licence_file = next((p for p in (stdlib_root / "LICENSE.txt", stdlib_root / "LICENSE") if p.exists()), None)
    stdlib_kept, stdlib_bytes = [], 0
    for doc_id, text in stdlib_docs:
        if stdlib_bytes + len(text) > args.stdlib_bytes:
            continue
        stdlib_kept.append((doc_id, text, "python-stdlib", "source"))
        stdlib_bytes += len(text)
    sources = [{
        "name": "python-stdlib", "version": sys.version.split()[0], "licence": "PSF-2.0",
        "licence_evidence": str(licence_file) if licence_file else "CPython standard library",
        "path": str(stdlib_root), "kind": "Python source (.py)", "documents": len(stdlib_kept),
        "bytes": stdlib_bytes,
    }]
    log(f"stdlib {stdlib_root}: {len(stdlib_kept)} files, {stdlib_bytes / 1e6:.1f} MB")

    # One entry per normalised distribution name (the first found on sys.path wins, as import does).
    distributions = {}
    for dist in importlib_metadata.distributions():
        name = dist.metadata.get("Name")
        if not name:
            continue
        key = re.sub(r"[-_.]+", "-", name).lower()
        distributions.setdefault(key, dist)
    permissive, rejected = [], []
    for key in sorted(distributions):
        dist = distributions[key]
        licence, ok = package_licence(dist.metadata)
        entry = {"name": dist.metadata["Name"], "version": dist.version, "licence": licence}
        (permissive if ok else rejected).append(entry)
    log(f"{len(permissive)} permissive distributions, {len(rejected)} excluded")

    tasks = [(entry["name"], int(args.docs_per_package_bytes), args.max_doc_bytes) for entry in permissive]
    with multiprocessing.get_context("fork").Pool(min(16, os.cpu_count() or 1)) as pool:
        extracted = dict(pool.map(package_documents, tasks, chunksize=1))

    seen_docstrings = set()
    per_package = []
    for entry in permissive:
        docs = []
        for doc_id, text, kind in extracted[entry["name"]]:
            if kind == "docstrings":
                text = drop_seen_paragraphs(text, seen_docstrings)
                if len(text) < 200:
                    continue
            docs.append((doc_id, text, kind))
        per_package.append(docs)
    limit = water_fill([sum(len(t) for _, t, _ in docs) for docs in per_package], int(args.docs_bytes))
    docs_kept = []
    for entry, docs in zip(permissive, per_package):
        taken, taken_bytes, kinds = 0, 0, {}
        for doc_id, text, kind in docs:
            if taken_bytes + len(text) > limit:
                break
            docs_kept.append((doc_id, text, entry["name"], kind))
            taken += 1
            taken_bytes += len(text)
            kinds[kind] = kinds.get(kind, 0) + len(text)
        if taken:
            sources.append({**entry, "kind": "documentation: " + ", ".join(sorted(kinds)), "documents": taken,
                            "bytes": taken_bytes, "bytes_by_kind": kinds})
    log(f"documentation: {len(docs_kept)} documents, {sum(len(d[1]) for d in docs_kept) / 1e6:.1f} MB "
        f"from {len(sources) - 1} packages (per-package limit {limit / 1e6:.2f} MB)")
    return stdlib_kept + docs_kept, sources, rejected


def is_heldout(doc_id, permille):
    return int(hashlib.sha1(doc_id.encode("utf-8")).hexdigest(), 16) % 1000 < permille


def heldout_text(heldout_docs, min_bytes, max_bytes):
    """A held-out evaluation text: whole held-out documents, code and documentation alternately, in hash order."""
    code = [d for d in heldout_docs if d[3] == "source"]
    prose = [d for d in heldout_docs if d[3] != "source"]
    pieces, used, total = [], [], 0
    queues = [code, prose]
    turn = 0
    while total < min_bytes and any(queues):
        queue = queues[turn % 2] or queues[(turn + 1) % 2]
        turn += 1
        while queue:
            doc_id, text, _, _ = queue.pop(0)
            size = len(text.encode("utf-8")) + 2
            # Pieces of at most half the text, so that it holds both code and prose.
            if 1000 <= size <= max_bytes // 2 and total + size <= max_bytes:
                pieces.append(text.strip("\n"))
                used.append(doc_id)
                total += size
                break
    return "\n\n".join(pieces) + "\n", used


# ------------------------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(train_texts, args):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(THINK_TOKENS), min_frequency=2, show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    sample, total = [], 0
    for text in train_texts:
        if total >= args.tokenizer_bytes:
            break
        sample.append(text)
        total += len(text)
    tokenizer.train_from_iterator(sample, trainer=trainer, length=len(sample))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != VOCAB_SIZE:
        raise SystemExit(f"tokenizer has {size} tokens, not {VOCAB_SIZE}")
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS + THINK_TOKENS}
    expected = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    expected.update({t: VOCAB_SIZE - len(THINK_TOKENS) + i for i, t in enumerate(THINK_TOKENS)})
    if ids != expected:  # tokenizer_config()'s added_tokens_decoder assumes these ids
        raise SystemExit(f"special token ids {ids}, expected {expected}")
    log(f"tokenizer: {size} tokens trained on {total / 1e6:.1f} MB; ids {ids}")
    return tokenizer, total


def save_tokenizer(tokenizer, path):
    """Writes tokenizer.json with the ByteLevel decoder and post-processor flags Qwen's files have (they change no
    ids: the post-processor only trims offsets) and returns the tokenizer read back from the file."""
    from tokenizers import Tokenizer

    spec = json.loads(tokenizer.to_str())
    for section in ("decoder", "post_processor"):
        spec[section].update({"add_prefix_space": False, "trim_offsets": False, "use_regex": False})
    spec["pre_tokenizer"]["pretokenizers"][-1]["trim_offsets"] = False
    path.write_text(json.dumps(spec, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return Tokenizer.from_file(str(path))


def tokenizer_config():
    decoder = {}
    for index, token in enumerate(SPECIAL_TOKENS):
        decoder[str(index)] = {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                               "single_word": False, "special": True}
    for offset, token in enumerate(THINK_TOKENS):
        decoder[str(VOCAB_SIZE - len(THINK_TOKENS) + offset)] = {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": False}
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "errors": "replace",
        "model_max_length": 8192,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


# ------------------------------------------------------------------------------------------------------------
# Model


def build_config(args, eos_id):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    rotary_dim = int(args.head_dim * 0.25)
    # mrope sections split the rotary frequencies (rotary_dim / 2) between the t, h, w position rows; for text all
    # three rows are equal, so only their sum matters. Qwen3.5's [11, 11, 10] is for rotary_dim 64.
    half = rotary_dim // 2
    mrope_section = [half - 2 * (half // 3), half // 3, half // 3]
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(args.layers)]
    return Qwen3_5TextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, hidden_act="silu", max_position_embeddings=args.max_position,
        initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta, "partial_rotary_factor": 0.25,
                         "mrope_section": mrope_section, "mrope_interleaved": True},
        attention_bias=False, attention_dropout=0.0, linear_conv_kernel_dim=4,
        linear_key_head_dim=args.linear_head_dim, linear_value_head_dim=args.linear_head_dim,
        linear_num_key_heads=args.linear_key_heads, linear_num_value_heads=args.linear_value_heads,
        layer_types=layer_types, pad_token_id=None, bos_token_id=None, eos_token_id=eos_id,
    )


def make_mtp_head_class():
    import torch
    from torch import nn
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

    class MtpHead(nn.Module):
        """Qwen3.5 / Qwen3-Next MTP module; state_dict keys are the checkpoint's `mtp.*` keys without `mtp.`."""

        def __init__(self, config, seed):
            super().__init__()
            hidden = config.hidden_size
            layer_config = copy.deepcopy(config)
            # The MTP layer is a full-attention decoder layer whatever the trunk's layer 0 is.
            layer_config.layer_types = ["full_attention"] * config.num_hidden_layers
            layer_config._attn_implementation = "sdpa"
            self.pre_fc_norm_embedding = Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps)
            self.pre_fc_norm_hidden = Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps)
            self.fc = nn.Linear(2 * hidden, hidden, bias=False)
            self.layers = nn.ModuleList([Qwen3_5DecoderLayer(layer_config, 0)])
            self.norm = Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps)
            # Linear weights ~ N(0, initializer_range) as transformers initialises the trunk; norms start at 0
            # (zero-centred: scale 1).
            generator = torch.Generator().manual_seed(seed)
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    with torch.no_grad():
                        module.weight.copy_(torch.randn(module.weight.shape, generator=generator)
                                            * config.initializer_range)

        def forward(self, hidden, next_embeds, position_embeddings):
            """hidden [B, L, H]: trunk output h_t (after the final norm); next_embeds [B, L, H]: embed(x_{t+1}).
            Returns the MTP hidden state [B, L, H] (after mtp.norm); attention is causal over the L rows."""
            x = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], -1))
            for layer in self.layers:
                x = layer(x, position_embeddings=position_embeddings, attention_mask=None)
                if isinstance(x, tuple):
                    x = x[0]
            return self.norm(x)

    return MtpHead


def text_positions(batch, length, device):
    import torch

    # Qwen3.5's rotary embedding takes the three mrope rows (t, h, w); text uses the same position in all three.
    return torch.arange(length, device=device).view(1, 1, -1).expand(3, batch, -1)


def mtp_forward(model, mtp, hidden, next_ids):
    """MTP hidden states [B, L, H] for trunk states hidden [B, L, H] and the following tokens next_ids [B, L]."""
    embeds = model.model.embed_tokens(next_ids)
    positions = text_positions(hidden.shape[0], hidden.shape[1], hidden.device)
    position_embeddings = model.model.rotary_emb(hidden.float(), positions)
    return mtp(hidden, embeds, position_embeddings)


def losses(model, mtp, window):
    """Main and MTP cross-entropy of a batch of windows [B, T+1]: tokens 1..T from 0..T-1, and 2..T from the
    trunk at 0..T-2 plus the true tokens 1..T-1."""
    import torch.nn.functional as F

    inputs = window[:, :-1]
    hidden = model.model(input_ids=inputs, use_cache=False).last_hidden_state
    logits = model.lm_head(hidden)
    vocab = logits.shape[-1]
    main = F.cross_entropy(logits.float().reshape(-1, vocab), window[:, 1:].reshape(-1))
    mtp_hidden = mtp_forward(model, mtp, hidden[:, :-1], window[:, 1:-1])
    mtp_logits = model.lm_head(mtp_hidden)
    draft = F.cross_entropy(mtp_logits.float().reshape(-1, vocab), window[:, 2:].reshape(-1))
    return main, draft


def evaluate(model, mtp, stream, seq_len, max_windows, batch_size):
    """Held-out metrics over non-overlapping windows of seq_len + 1 tokens."""
    import torch
    import torch.nn.functional as F

    count = min(max_windows, (len(stream) - 1) // seq_len)
    sums = {"nll": 0.0, "mtp_nll": 0.0, "mtp_correct": 0, "mtp_agree": 0, "main_correct": 0}
    tokens = mtp_tokens = 0
    with torch.no_grad():
        for start in range(0, count, batch_size):
            index = torch.arange(start, min(start + batch_size, count), device=stream.device)
            offsets = index[:, None] * seq_len + torch.arange(seq_len + 1, device=stream.device)
            window = stream[offsets].long()
            hidden = model.model(input_ids=window[:, :-1], use_cache=False).last_hidden_state
            logits = model.lm_head(hidden).float()
            targets = window[:, 1:]
            sums["nll"] += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                           reduction="sum").item()
            main_argmax = logits.argmax(-1)
            sums["main_correct"] += (main_argmax == targets).sum().item()
            tokens += targets.numel()
            mtp_logits = model.lm_head(mtp_forward(model, mtp, hidden[:, :-1], window[:, 1:-1])).float()
            mtp_targets = window[:, 2:]
            sums["mtp_nll"] += F.cross_entropy(mtp_logits.reshape(-1, mtp_logits.shape[-1]),
                                               mtp_targets.reshape(-1), reduction="sum").item()
            draft = mtp_logits.argmax(-1)
            sums["mtp_correct"] += (draft == mtp_targets).sum().item()
            # Greedy speculative decoding accepts the draft for x_{t+2} when the trunk's own argmax at t+1 agrees.
            sums["mtp_agree"] += (draft == main_argmax[:, 1:]).sum().item()
            mtp_tokens += mtp_targets.numel()
    loss = sums["nll"] / tokens
    return {
        "windows": count, "seq_len": seq_len, "tokens": tokens,
        "loss": loss, "perplexity": math.exp(loss), "top1_accuracy": sums["main_correct"] / tokens,
        "mtp_loss": sums["mtp_nll"] / mtp_tokens, "mtp_top1_accuracy": sums["mtp_correct"] / mtp_tokens,
        "mtp_acceptance": sums["mtp_agree"] / mtp_tokens,
    }


def check_mtp_causal(mtp, model, device):
    """The MTP layer must attend causally (sdpa with no mask runs is_causal); a change at row 10 must not move
    rows 0..9."""
    import torch

    generator = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(1, 16, model.config.hidden_size, generator=generator).to(device)
    ids = torch.randint(0, VOCAB_SIZE, (1, 16), generator=generator).to(device)
    with torch.no_grad():
        before = mtp_forward(model, mtp, hidden, ids)
        changed = ids.clone()
        changed[0, 10] = (changed[0, 10] + 1) % VOCAB_SIZE
        after = mtp_forward(model, mtp, hidden, changed)
    earlier = (before[:, :10] - after[:, :10]).abs().max().item()
    later = (before[:, 10:] - after[:, 10:]).abs().max().item()
    if earlier > 1e-6 or later < 1e-4:
        raise SystemExit(f"MTP layer attention is not causal (change before row 10: {earlier}, after: {later})")


def count_parameters(module):
    return sum(p.numel() for p in module.parameters())


def lr_at(step, planned, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, planned - args.warmup))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def rel_l2(a, b):
    import numpy as np

    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def mean_nll(logits, ids):
    """metrale score's perplexity: mean NLL of tokens 1..T-1 from rows 0..T-2, in float64."""
    import numpy as np

    rows = np.asarray(logits[:-1], dtype=np.float64)
    peak = rows.max(axis=1, keepdims=True)
    log_z = peak[:, 0] + np.log(np.exp(rows - peak).sum(axis=1))
    return float(np.mean(log_z - rows[np.arange(len(ids) - 1), np.asarray(ids[1:])]))


# ------------------------------------------------------------------------------------------------------------
# Main


def main():
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"args": vars(args), "python": sys.version.split()[0]}

    # 1. Corpus (CPU, before torch: the worker pool forks a small process).
    documents, sources, rejected = build_corpus(args)
    heldout_docs = [d for d in documents if is_heldout(d[0], args.heldout_permille)]
    train_docs = [d for d in documents if not is_heldout(d[0], args.heldout_permille)]
    heldout_docs.sort(key=lambda d: hashlib.sha1(d[0].encode("utf-8")).hexdigest())
    record["corpus"] = {
        "documents": len(documents), "bytes": sum(len(d[1]) for d in documents),
        "train_documents": len(train_docs), "train_bytes": sum(len(d[1]) for d in train_docs),
        "heldout_documents": len(heldout_docs), "heldout_bytes": sum(len(d[1]) for d in heldout_docs),
        "heldout_rule": f"sha1(document id) mod 1000 < {args.heldout_permille}",
        "sources": sources, "excluded_distributions": rejected,
        "seconds": time.time() - START_TIME,
    }
    log(f"corpus: {len(train_docs)} train / {len(heldout_docs)} held-out documents, "
        f"{record['corpus']['train_bytes'] / 1e6:.1f} / {record['corpus']['heldout_bytes'] / 1e6:.2f} MB")

    import numpy as np

    order = np.random.default_rng(args.seed).permutation(len(train_docs))
    train_texts = [train_docs[i][1] for i in order]

    # 2. Tokenizer.
    tokenizer_start = time.time()
    tokenizer, tokenizer_bytes = train_tokenizer(train_texts, args)
    tokenizer = save_tokenizer(tokenizer, out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n")
    eos_id = tokenizer.token_to_id("<|endoftext|>")
    im_end_id = tokenizer.token_to_id("<|im_end|>")

    def encode_stream(texts):
        """The documents' ids, each followed by <|endoftext|>, as one int32 array."""
        parts = []
        for start in range(0, len(texts), 2000):
            for encoding in tokenizer.encode_batch(texts[start:start + 2000]):
                parts.append(np.asarray(encoding.ids + [eos_id], dtype=np.int32))
        return np.concatenate(parts)

    train_stream = encode_stream(train_texts)
    heldout_stream = encode_stream([d[1] for d in heldout_docs])
    record["tokenizer"] = {
        "vocab_size": VOCAB_SIZE, "trained_on_bytes": tokenizer_bytes, "special_tokens": SPECIAL_TOKENS,
        "added_non_special": THINK_TOKENS, "eos": "<|endoftext|>", "eos_id": eos_id,
        "train_tokens": int(len(train_stream)), "heldout_tokens": int(len(heldout_stream)),
        "bytes_per_token": record["corpus"]["train_bytes"] / max(1, len(train_stream)),
        "seconds": time.time() - tokenizer_start,
    }
    log(f"tokens: train {len(train_stream) / 1e6:.2f} M, held-out {len(heldout_stream) / 1e6:.3f} M "
        f"({record['tokenizer']['bytes_per_token']:.2f} bytes/token)")

    heldout_eval_text, heldout_eval_docs = heldout_text(heldout_docs, *args.heldout_text_bytes)
    (out / "heldout.txt").write_text(heldout_eval_text, encoding="utf-8")

    # 3. Model.
    import torch
    import transformers
    from transformers import GenerationConfig, Qwen3_5ForCausalLM

    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = build_config(args, eos_id)
    config._attn_implementation = "sdpa"
    model = Qwen3_5ForCausalLM(config)
    mtp = make_mtp_head_class()(model.config, args.seed + 1)
    model.to(device)
    mtp.to(device)
    check_mtp_causal(mtp, model, device)
    params_trunk = count_parameters(model)
    params_mtp = count_parameters(mtp)
    record["model"] = {
        "class": "Qwen3_5ForCausalLM", "model_type": model.config.model_type,
        "attn_implementation": model.config._attn_implementation,
        "layer_types": model.config.layer_types, "parameters": params_trunk, "mtp_parameters": params_mtp,
        "embedding_parameters": VOCAB_SIZE * args.hidden,
    }
    log(f"model: {params_trunk / 1e6:.2f} M parameters (+{params_mtp / 1e6:.2f} M MTP), "
        f"layers {model.config.layer_types}")

    # 4. Training.
    decay, no_decay = [], []
    for module in (model, mtp):
        for parameter in module.parameters():
            (decay if parameter.ndim >= 2 else no_decay).append(parameter)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    stream = torch.from_numpy(train_stream).to(device)
    heldout = torch.from_numpy(heldout_stream).to(device)
    sampler = torch.Generator(device="cpu").manual_seed(args.seed)

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    train_budget = min(args.time_budget, args.total_budget - (time.time() - START_TIME) - 110.0)
    log(f"training budget {train_budget:.0f} s")
    planned = args.steps if args.steps > 0 else None
    # Step-time probes: steps [5, 25) at --seq-len and [25, 30) at --long-seq-len (also when --steps is given, so
    # that a run with the recorded steps repeats the same sequence of batches).
    short_probe = (5, 25)
    long_probe = (25, 30)
    probe_times = {}
    curve, evals = [], []
    step = 0
    train_start = time.time()
    probe_start = None
    running = {"loss": 0.0, "mtp_loss": 0.0, "n": 0}
    tokens_seen = 0
    model.train()
    mtp.train()
    while True:
        elapsed = time.time() - train_start
        if planned is not None and step >= planned:
            break
        if elapsed > train_budget:
            log(f"wall clock: stopping at step {step} of {planned}")
            break
        long_phase = planned is not None and step >= int(planned * (1 - args.long_frac))
        if long_probe[0] <= step < long_probe[1]:
            long_phase = True
        seq_len = args.long_seq_len if long_phase else args.seq_len
        rows = max(args.micro_batches, args.batch_tokens // seq_len)
        offsets = torch.randint(0, len(stream) - seq_len - 1, (rows,), generator=sampler)
        lr = lr_at(step, planned or 10**9, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        step_loss = step_mtp = 0.0
        for micro in offsets.chunk(args.micro_batches):
            index = micro.to(device)[:, None] + torch.arange(seq_len + 1, device=device)
            window = stream[index].long()
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                main_loss, mtp_loss = losses(model, mtp, window)
                loss = (main_loss + args.mtp_weight * mtp_loss) / args.micro_batches
            loss.backward()
            step_loss = step_loss + main_loss.detach() / args.micro_batches
            step_mtp = step_mtp + mtp_loss.detach() / args.micro_batches
        torch.nn.utils.clip_grad_norm_(decay + no_decay, 1.0)
        optimizer.step()
        tokens_seen += rows * seq_len
        running["loss"] += step_loss
        running["mtp_loss"] += step_mtp
        running["n"] += 1
        step += 1
        if step in (short_probe[0], long_probe[0], long_probe[1]):
            synchronize()
            now = time.time()
            if step == long_probe[0]:
                probe_times["short"] = (now - probe_start) / (short_probe[1] - short_probe[0])
            elif step == long_probe[1]:
                probe_times["long"] = (now - probe_start) / (long_probe[1] - long_probe[0])
            probe_start = now
        if planned is None and step == long_probe[1]:
            # P total steps: (P - step - f P) short steps and f P long ones must fit the remaining time.
            remaining = 0.96 * (train_budget - (time.time() - train_start))
            short, long_ = probe_times["short"], probe_times["long"]
            planned = int((remaining + step * short) / (short * (1 - args.long_frac) + long_ * args.long_frac))
            log(f"step time {short * 1000:.0f} ms at {args.seq_len}, {long_ * 1000:.0f} ms at "
                f"{args.long_seq_len}: planning {planned} steps")
        if step % 25 == 0 or step == 1:
            entry = {"step": step, "seconds": round(time.time() - train_start, 1), "lr": lr, "seq_len": seq_len,
                     "loss": float(running["loss"] / running["n"]),
                     "mtp_loss": float(running["mtp_loss"] / running["n"]), "tokens": tokens_seen}
            curve.append(entry)
            running = {"loss": 0.0, "mtp_loss": 0.0, "n": 0}
            if step % 100 == 0 or step == 1:
                log(f"step {step}: loss {entry['loss']:.3f} mtp {entry['mtp_loss']:.3f} lr {lr:.2e} "
                    f"T {seq_len} tokens {tokens_seen / 1e6:.1f} M")
        if planned and step % max(100, planned // 6) == 0:
            model.eval()
            mtp.eval()
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                metrics = evaluate(model, mtp, heldout, args.seq_len, 32, 32)
            model.train()
            mtp.train()
            evals.append({"step": step, "seconds": round(time.time() - train_start, 1), **metrics})
            log(f"step {step}: held-out loss {metrics['loss']:.3f} mtp acc {metrics['mtp_top1_accuracy']:.3f}")
    synchronize()
    train_seconds = time.time() - train_start
    record["step_time_probes_s"] = probe_times
    record["training"] = {
        "steps_done": step, "steps_planned": planned, "seconds": train_seconds, "tokens_seen": tokens_seen,
        "epochs": tokens_seen / len(train_stream), "tokens_per_second": tokens_seen / train_seconds,
        "batch_tokens": args.batch_tokens, "curve": curve, "heldout_during_training": evals,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
    }
    log(f"trained {step} steps in {train_seconds:.0f} s, {tokens_seen / 1e6:.0f} M tokens "
        f"({tokens_seen / train_seconds / 1e3:.0f} k tokens/s)")

    # 5. bf16 rounding (parameters only) and saving.
    model.eval()
    mtp.eval()
    with torch.no_grad():
        for module in (model, mtp):
            for parameter in module.parameters():
                parameter.copy_(parameter.to(torch.bfloat16).to(torch.float32))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    final = evaluate(model, mtp, heldout, args.seq_len, args.eval_windows, 32)
    record["heldout_final"] = final
    log(f"held-out (bf16 weights, fp32 math): loss {final['loss']:.4f} ppl {final['perplexity']:.2f} "
        f"top-1 {final['top1_accuracy']:.3f}; MTP loss {final['mtp_loss']:.4f} top-1 "
        f"{final['mtp_top1_accuracy']:.3f} acceptance {final['mtp_acceptance']:.3f}")

    from safetensors.torch import load_file, save_file

    saved = copy.deepcopy(model).to("cpu").to(torch.bfloat16)
    saved.config.dtype = torch.bfloat16
    saved.generation_config = GenerationConfig(
        eos_token_id=[im_end_id, eos_id], pad_token_id=eos_id, do_sample=True, temperature=0.7, top_p=0.9,
        top_k=40)
    saved.save_pretrained(out, safe_serialization=True)
    del saved
    weights_path = out / "model.safetensors"
    tensors = load_file(str(weights_path))
    for name, tensor in mtp.state_dict().items():
        tensors[f"mtp.{name}"] = tensor.detach().to("cpu", torch.bfloat16).contiguous()
    save_file(tensors, str(weights_path), metadata={"format": "pt"})
    config_json = json.loads((out / "config.json").read_text())
    config_json["mtp_num_hidden_layers"] = 1
    config_json["mtp_use_dedicated_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    keys = sorted(tensors)
    record["checkpoint"] = {
        "bytes": weights_path.stat().st_size, "tensors": len(keys),
        "mtp_keys": {k: list(tensors[k].shape) for k in keys if k.startswith("mtp.")},
        "has_lm_head": "lm_head.weight" in tensors,
    }
    log(f"model.safetensors: {weights_path.stat().st_size / 1e6:.1f} MB, {len(keys)} tensors "
        f"({len(record['checkpoint']['mtp_keys'])} mtp.*)")

    # 6./7. References on the CPU in fp32 from the saved files. A failing check is recorded and the script goes
    # on, so that train_log.json is always written; the exit status is non-zero then.
    errors = []

    def attempt(name, action):
        try:
            return action()
        except Exception:  # noqa: BLE001 - recorded, reported and turned into the exit status below
            errors.append(f"{name}: {traceback.format_exc()}")
            log(f"FAILED {name}:\n{traceback.format_exc()}")
            return None

    torch.set_num_threads(min(16, os.cpu_count() or 1))
    reference = attempt("reload", lambda: load_reference(out))
    heldout_ids = tokenizer.encode(heldout_eval_text, add_special_tokens=True).ids
    record["chat_template_example"] = attempt("tokenizer", lambda: check_tokenizer(out, heldout_eval_text,
                                                                                    heldout_ids))
    if reference is not None:
        record["reference"] = attempt("snippet", lambda: snippet_reference(
            out, args, tokenizer, reference, model, mtp, device, heldout_docs, heldout_eval_docs))
        record["heldout_eval"] = attempt("heldout.txt", lambda: heldout_reference(
            args, reference, heldout_eval_text, heldout_eval_docs, heldout_ids))
        record["greedy_samples"] = attempt("samples", lambda: greedy_samples(reference, tokenizer, eos_id,
                                                                              im_end_id))
    record["errors"] = errors
    record["total_seconds"] = time.time() - START_TIME
    (out / "train_log.json").write_text(json.dumps(record, indent=1) + "\n")
    files = sorted(p.name for p in out.iterdir())
    log(f"done in {record['total_seconds']:.0f} s; {len(files)} files: "
        + ", ".join(f"{name} {(out / name).stat().st_size / 1e6:.2f} MB" for name in files))
    if len(files) > 8:
        errors.append(f"{len(files)} files in {out}: the device returns at most 8")
    if errors:
        raise SystemExit(f"{len(errors)} check(s) failed: " + "; ".join(e.splitlines()[0] for e in errors))


def load_reference(out):
    """The saved checkpoint in fp32 on the CPU; only the mtp.* keys may be left unused."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    reference, info = Qwen3_5ForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    reference.eval()
    unexpected = [k for k in info.get("unexpected_keys", []) if not k.startswith("mtp.")]
    if info.get("missing_keys") or unexpected or info.get("mismatched_keys"):
        raise RuntimeError(f"reloading the checkpoint: {info}")
    log(f"reloaded: {len(info.get('unexpected_keys', []))} unused keys (mtp.*)")
    return reference


def check_tokenizer(out, text, ids):
    """transformers' AutoTokenizer must load the files and agree with `tokenizers`; returns a rendered chat."""
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(out)
    if hf_tokenizer(text, add_special_tokens=True)["input_ids"] != ids:
        raise RuntimeError("AutoTokenizer and tokenizers disagree on heldout.txt")
    if hf_tokenizer.decode(ids) != text:
        raise RuntimeError("heldout.txt does not round-trip through decode")
    return hf_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                            add_generation_prompt=True)


def snippet_reference(out, args, tokenizer, reference, model, mtp, device, heldout_docs, heldout_eval_docs):
    """reference_logits.npy for the first tokens of a held-out document that is not in heldout.txt, plus the checks
    that validate it and the MTP head's drafts on it."""
    import numpy as np
    import torch

    snippet_doc = next(d for d in heldout_docs if d[0] not in heldout_eval_docs
                       and len(tokenizer.encode(d[1]).ids) >= args.snippet_tokens)
    snippet_ids = tokenizer.encode(snippet_doc[1]).ids[: args.snippet_tokens]
    with torch.no_grad():
        snippet = torch.tensor([snippet_ids])
        reference_logits = reference(snippet, use_cache=False).logits[0].numpy().astype("<f4")
        np.save(out / "reference_logits.npy", reference_logits)
        gpu_logits = model(snippet.to(device), use_cache=False).logits[0].float().cpu().numpy()
        # Token-by-token decoding through transformers' own cache against its full forward (qwen.md 9.2).
        cache = None
        steps = []
        for t in range(len(snippet_ids)):
            output = reference(snippet[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = output.past_key_values
            steps.append(output.logits[0, -1].numpy())
        incremental = np.stack(steps)
        # MTP drafts for the snippet (fp32, CPU): the reference for an engine's MTP head.
        mtp_cpu = copy.deepcopy(mtp).to("cpu")
        hidden = reference.model(input_ids=snippet, use_cache=False).last_hidden_state
        mtp_logits = reference.lm_head(mtp_forward(reference, mtp_cpu, hidden[:, :-1], snippet[:, 1:]))[0]
        mtp_top = torch.topk(mtp_logits, 5, dim=-1)
    result = {
        "file": "reference_logits.npy", "shape": list(reference_logits.shape), "dtype": "float32",
        "document": snippet_doc[0], "input_ids": snippet_ids, "text": tokenizer.decode(snippet_ids),
        "how": "Qwen3_5ForCausalLM.from_pretrained(out, dtype=float32, attn_implementation='eager'), CPU, one "
               "full forward, use_cache=False",
        "gpu_fp32_rel_l2": rel_l2(gpu_logits, reference_logits),
        "incremental_rel_l2": rel_l2(incremental, reference_logits),
        "mtp": {
            "how": "MTP head on the reference trunk, fp32 CPU: row t drafts x_{t+2} from h_t and x_{t+1} = "
                   "input_ids[t+1] (rows 0..T-2)",
            "draft_ids": mtp_top.indices[:, 0].tolist(),
            "top5_ids": mtp_top.indices.tolist(), "top5_logits": mtp_top.values.tolist(),
        },
    }
    log(f"reference: gpu-vs-cpu rel {result['gpu_fp32_rel_l2']:.2e}, incremental rel "
        f"{result['incremental_rel_l2']:.2e}")
    return result


def heldout_reference(args, reference, text, documents, ids):
    """The perplexity `metrale score --text` must reproduce on heldout.txt."""
    import torch

    with torch.no_grad():
        logits = reference(torch.tensor([ids]), use_cache=False).logits[0].numpy()
    nll = mean_nll(logits, ids)
    # For comparison: the same tokens scored in independent windows of the training length.
    window_nll, window_count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, args.seq_len):
            chunk = ids[start:start + args.seq_len + 1]
            if len(chunk) < 2:
                break
            chunk_logits = reference(torch.tensor([chunk]), use_cache=False).logits[0].numpy()
            window_nll += mean_nll(chunk_logits, chunk) * (len(chunk) - 1)
            window_count += len(chunk) - 1
    result = {
        "file": "heldout.txt", "bytes": len(text.encode("utf-8")), "documents": documents,
        "num_tokens": len(ids), "num_predicted": len(ids) - 1, "mean_nll": nll, "perplexity": math.exp(nll),
        "how": "as metrale score --text: tokenizer.encode(text, add_special_tokens=True) (adds nothing), one "
               "sequence, one forward, mean NLL of tokens 1..T-1 in float64; fp32 CPU from the saved checkpoint",
        "windowed_perplexity": math.exp(window_nll / max(1, window_count)),
        "windowed_perplexity_window": args.seq_len,
        "input_ids": ids,
    }
    log(f"heldout.txt: {result['bytes']} bytes, {len(ids)} tokens, perplexity {result['perplexity']:.3f} "
        f"(windows of {args.seq_len}: {result['windowed_perplexity']:.3f})")
    return result


def greedy_samples(reference, tokenizer, eos_id, im_end_id):
    """A few greedy continuations (the trunk, bf16 weights in fp32 math), for the README."""
    import torch

    samples = {}
    for prompt in ["def fibonacci(n):\n", "import os\n\n\ndef ", "The following example shows how to"]:
        ids = torch.tensor([tokenizer.encode(prompt).ids])
        with torch.no_grad():
            generated = reference.generate(ids, max_new_tokens=48, do_sample=False,
                                           eos_token_id=[eos_id, im_end_id], pad_token_id=eos_id)
        samples[prompt] = tokenizer.decode(generated[0, ids.shape[1]:].tolist())
        log(f"sample {prompt!r} -> {samples[prompt]!r}")
    return samples

if __name__ == "__main__":
    main()
