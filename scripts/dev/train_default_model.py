#!/usr/bin/env python
"""Train the small default model that ships inside longserve (longserve/assets/default_model).

Everything is offline: the training text is the docstrings of the running Python's standard library (read
with `ast`, files in sorted order) plus pydoc's topic pages (the language reference `help()` shows). A
ByteLevel BPE tokenizer is trained on that text, then a tiny Llama (`LlamaForCausalLM`) is trained on CPU
with AdamW for a fixed wall-clock budget and saved in HF format (bfloat16 safetensors, tokenizer with a
ChatML chat template, generation_config) so both longserve and transformers load it. A quarter of the
docstrings are shown as ChatML conversations ("What does `json.dumps` do?" -> the docstring), so the chat
endpoints answer in the same docs-flavoured English and stop with <|im_end|>.

    python scripts/dev/train_default_model.py               # ~10 minutes, writes longserve/assets/default_model
    python scripts/dev/train_default_model.py --minutes 2 --out /tmp/m
    python scripts/dev/train_default_model.py --steps 3000  # a fixed step count instead of a time budget

Torch runs on one thread (the default model must be cheap to rebuild on any laptop). Runs with the same
seed and --steps give the same model on the same Python/torch; a --minutes run stops after as many steps
as fit, so it varies with the machine.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import sys
import sysconfig
import time
import zlib

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one CPU thread for everything
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(REPO, "longserve", "assets", "default_model")

BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]  # ids 0, 1, 2, 3
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = 0, 1, 2, 3
VOCAB_SIZE = 4096

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

MODEL = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    initializer_range=0.02,
    tie_word_embeddings=True,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)

# directories of the stdlib that are tests, demos or vendored code rather than documented API
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "turtledemo"}
_QUESTIONS = ("What does `{}` do?", "Explain `{}`.", "How do I use `{}`?", "Tell me about `{}`.")


# ---------------------------------------------------------------------------------------------- text
def _docstrings(path: str, module: str) -> list[tuple[str, str]]:
    """(qualified name, cleaned docstring) of a module and its classes/functions, in source order."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    out: list[tuple[str, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        doc = ast.get_docstring(node, clean=True)
        if doc and len(doc) >= 20:
            out.append((prefix, doc))
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, f"{prefix}.{child.name}")

    visit(tree, module)
    return out


def gather_documents() -> tuple[list[str], int]:
    """Training documents (plain docstrings and ChatML conversations) in a deterministic order.
    Returns (documents, number of source files read)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    docs: list[str] = []
    files = 0
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("test"))
        rel = os.path.relpath(dirpath, stdlib)
        pkg = "" if rel == "." else rel.replace(os.sep, ".") + "."
        for fn in sorted(filenames):
            if not fn.endswith(".py") or fn.startswith("test_"):
                continue
            stem = fn[:-3]
            module = pkg[:-1] if stem == "__init__" else pkg + stem
            entries = _docstrings(os.path.join(dirpath, fn), module)
            files += bool(entries)
            for name, doc in entries:
                h = zlib.crc32(name.encode())
                if h % 4 == 0:  # a quarter as chat: the question names the object, the answer is its docs
                    question = _QUESTIONS[(h >> 2) % len(_QUESTIONS)].format(name)
                    docs.append(
                        f"{BOS}{IM_START}user\n{question}{IM_END}\n{IM_START}assistant\n{doc}{IM_END}\n"
                    )
                else:
                    docs.append(f"{BOS}{doc}{EOS}")
    try:  # pydoc's topic pages: the language reference as plain text
        from pydoc_data.topics import topics

        docs.extend(f"{BOS}{topics[k].strip()}{EOS}" for k in sorted(topics))
    except ImportError:
        pass
    return docs, files


# ------------------------------------------------------------------------------------------ tokenizer
def train_tokenizer(docs: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )

    def texts():
        for d in docs:
            for s in SPECIAL_TOKENS:
                d = d.replace(s, "\n")
            yield d

    tok.train_from_iterator(texts(), trainer=trainer, length=len(docs))
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [BOS_ID, EOS_ID, IM_START_ID, IM_END_ID]
    # like Llama 3: encode() prepends <|begin_of_text|>
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    return tok


# ---------------------------------------------------------------------------------------------- train
def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to 10% of peak as progress goes 0 -> 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT, help="output directory (default: %(default)s)")
    ap.add_argument("--minutes", type=float, default=10.0, help="training wall-clock budget (default 10)")
    ap.add_argument(
        "--steps", type=int, default=None, help="train exactly this many steps (overrides --minutes)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=torch.cpu._is_avx512_bf16_supported(),
        help="bfloat16 autocast for matmuls (default: on where the CPU has native bf16, ~1.5x faster)",
    )
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    t0 = time.time()

    import transformers

    docs, nfiles = gather_documents()
    nchars = sum(map(len, docs))
    print(f"text: {len(docs)} documents from {nfiles} stdlib files, {nchars / 1e6:.2f} MB", flush=True)

    tok = train_tokenizer(docs)
    encoded = [enc.ids for enc in tok.encode_batch(docs, add_special_tokens=False)]
    # every 50th document (by content hash) is held out to report a validation loss
    held = [zlib.crc32(d.encode()) % 50 == 0 for d in docs]
    train = torch.tensor([i for e, h in zip(encoded, held) if not h for i in e], dtype=torch.long)
    val = torch.tensor([i for e, h in zip(encoded, held) if h for i in e], dtype=torch.long)
    data = torch.cat([train, val])
    print(
        f"tokenizer: vocab {VOCAB_SIZE}, {len(data) / 1e6:.2f}M tokens ({nchars / len(data):.2f} chars/token); "
        f"{time.time() - t0:.0f}s",
        flush=True,
    )

    config = transformers.LlamaConfig(**MODEL)
    model = transformers.LlamaForCausalLM(config).float()
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, bf16 autocast {args.bf16}: {MODEL}", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(args.seed)
    seq, bs = args.seq_len, args.batch_size
    offsets = torch.arange(seq + 1)

    def batch(src: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(src) - seq - 1, (bs,), generator=g)
        chunk = src[starts[:, None] + offsets]
        return chunk[:, :-1], chunk[:, 1:]

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(input_ids=x).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

    budget = args.minutes * 60
    t_train = time.time()
    step, ema = 0, None
    warmup = 100
    while True:
        elapsed = time.time() - t_train
        progress = step / args.steps if args.steps else elapsed / budget
        if progress >= 1.0:
            break
        lr = lr_at(step, progress, args.lr, warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = batch(train, gen)
        loss = loss_of(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % args.log_every == 0 or step == 1:
            tps = step * bs * seq / max(time.time() - t_train, 1e-9)
            print(
                f"step {step:5d}  loss {ema:.3f}  lr {lr:.2e}  {tps:,.0f} tok/s  {elapsed / 60:5.1f} min",
                flush=True,
            )
    train_s = time.time() - t_train

    model.eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(1234)
        val_loss = sum(loss_of(*batch(val, g)).item() for _ in range(8)) / 8
    print(
        f"trained {step} steps ({step * bs * seq / 1e6:.2f}M tokens) in {train_s / 60:.1f} min; "
        f"train loss {ema:.3f}, held-out loss {val_loss:.3f}",
        flush=True,
    )

    save(model, tok, args.out, info=dict(steps=step, train_loss=ema, val_loss=val_loss, minutes=train_s / 60))
    print(f"sample: {sample(model, tok, 'Return the')!r}", flush=True)
    print(f"total {(time.time() - t0) / 60:.1f} min", flush=True)
    return 0


def save(model, tok, out: str, info: dict) -> None:
    import transformers

    os.makedirs(out, exist_ok=True)
    for stale in _OUTPUT_FILES:  # e.g. a chat_template.jinja from another transformers version
        if os.path.exists(os.path.join(out, stale)):
            os.remove(os.path.join(out, stale))
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out)
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.model_max_length = MODEL["max_position_embeddings"]
    hf_tok.save_pretrained(out, save_jinja_files=False)  # the template inside tokenizer_config.json
    # the class name every transformers version knows (5.x writes its new "TokenizersBackend")
    path = os.path.join(out, "tokenizer_config.json")
    with open(path) as f:
        tok_config = json.load(f)
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(path, "w") as f:
        json.dump(tok_config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID]}, f, indent=2)
        f.write("\n")
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(_MODEL_CARD.format(python=sys.version.split()[0], torch=torch.__version__, **info, **MODEL))
    for name in os.listdir(out):  # safetensors writes 0600; the files ship in a package others read
        os.chmod(os.path.join(out, name), 0o644)
    total = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"saved to {out}: {', '.join(sorted(os.listdir(out)))} ({total / 1e6:.2f} MB)", flush=True)


@torch.no_grad()
def sample(model, tok, prompt: str, n: int = 30) -> str:
    model = model.float().eval()
    g = torch.Generator().manual_seed(0)
    ids = tok.encode(prompt).ids
    for _ in range(n):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1] / 0.7
        nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
        if nxt in (EOS_ID, IM_END_ID):
            break
        ids.append(nxt)
    return tok.decode(ids, skip_special_tokens=True)


_OUTPUT_FILES = (
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "README.md",
)

_MODEL_CARD = """\
# longserve default model

A tiny Llama ({num_hidden_layers} layers, hidden {hidden_size}, {num_attention_heads} heads /
{num_key_value_heads} KV heads, vocab {vocab_size}, tied embeddings) trained from scratch for
{minutes:.1f} minutes on one CPU thread on the docstrings of Python's standard library and pydoc's topic
pages. It writes Python-docs-flavoured English; it knows nothing and is not useful beyond showing that
the server works. `longserve serve` serves it when no model is given.

- steps: {steps}, final train loss {train_loss:.3f}, held-out loss {val_loss:.3f}
- built with Python {python}, torch {torch}
- rebuild: `python scripts/dev/train_default_model.py` (see `--help`)
"""


if __name__ == "__main__":
    sys.exit(main())
