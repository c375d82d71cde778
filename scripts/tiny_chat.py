"""Chat conversations synthesized from Python source, for the bundled models' chat template.

Each documented function (top-level, or a method of a top-level class) of a
source file gives a request and its answer:

- "Write a Python function `name(args)` that <first docstring sentence>." answered
  with the function's source in a ```python fence;
- sometimes "What does this function do?" over the source without its
  docstring, answered with that sentence.

The assistant turn of every conversation ends with the tokenizer's EOS (the
chat template appends it), which is what teaches the model to stop. A few
hand-written exchanges (greetings, what the model is) are mixed in too.
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
from dataclasses import dataclass

Message = dict[str, str]

SYSTEM_PROMPT = "You are a helpful assistant that writes Python code."

# Verbs that open docstrings ("Return the ...", "Returns the ..."), in the base form.
VERBS = frozenset(
    """
    accept add adjust allow append apply ask assert build calculate call cancel check clean
    clear close collect combine compare compile compute configure construct convert copy count
    create decode define delete describe detect determine disable display download draw dump
    emit enable encode ensure escape evaluate execute expand export extract fetch fill filter
    find finish flatten flush format generate get give handle ignore import initialize insert
    install invert iterate join keep list load locate log look make map mark match merge move
    normalize open pad parse perform pick prepare print process produce quote raise read
    record reduce register reload remove rename render repeat replace report represent request
    reset resolve restore retrieve return reverse round run save scan search select send
    serialize set show shuffle skip sleep solve sort split start stop store strip substitute
    swap take tell test transform translate truncate try turn unpack unquote unregister update
    validate verify visit wait walk wrap write yield
    """.split()
)

WRITE_NAMED = (
    "Write a Python function `{sig}` that {third}.",
    "Write a function `{sig}` in Python that {third}.",
    "Implement `{sig}` in Python. It should {base}.",
    "Can you write a Python function `{sig}`? It {third}.",
)
WRITE_UNNAMED = (
    "Write a Python function that {third}.",
    "Write a function that {third}.",
)
WRITE_METHOD = ("Write the method `{sig}` of a Python class `{cls}`; it {third}.",)
EXPLAIN = (
    "What does this function do?\n\n```python\n{code}\n```",
    "Explain this Python code in one sentence:\n\n```python\n{code}\n```",
)

# NOTE: hand-written, so that greetings and questions about the model get a short
# answer that ends (the README's `llm.chat` example says "hi").
SMALL_TALK: tuple[tuple[str, str], ...] = (
    ("hi", "Hello! I am a small model trained on Python code. Ask me to write a Python function."),
    ("Hi!", "Hello! Ask me to write a Python function and I will try."),
    ("hello", "Hello! What Python function should I write?"),
    ("Hello, who are you?", "I am ssmserve-bamba-tiny, a small language model of Python code."),
    ("Who are you?", "I am ssmserve-bamba-tiny, a small language model of Python code."),
    ("What can you do?", "I write short Python functions. Describe the function you need."),
    ("Thanks!", "You are welcome."),
    ("thank you", "You are welcome."),
    ("What language do you write?", "Python."),
    ("Are you a large language model?", "No, I am a very small one: a few million parameters."),
)


@dataclass(frozen=True)
class FunctionInfo:
    """A documented function of a source file, as a chat example can use it."""

    path: str
    name: str
    cls: str | None  # the enclosing class of a method
    signature: str  # name(args), without annotations
    source: str  # decorators and body, dedented
    code_without_docstring: str | None
    base: str  # the docstring's first sentence, in the imperative ("return the ...")
    third: str  # the same in the third person ("returns the ...")


def _short_default(node: ast.expr) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 20 else "..."


def format_signature(name: str, args: ast.arguments) -> str:
    """``name(a, b=1, *rest, key=None, **kw)``: the call shape without annotations."""
    parts: list[str] = []
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        parts.append(arg.arg if default is None else f"{arg.arg}={_short_default(default)}")
        if args.posonlyargs and i == len(args.posonlyargs) - 1:
            parts.append("/")
    if args.vararg is not None:
        parts.append(f"*{args.vararg.arg}")
    elif args.kwonlyargs:
        parts.append("*")
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        parts.append(arg.arg if default is None else f"{arg.arg}={_short_default(default)}")
    if args.kwarg is not None:
        parts.append(f"**{args.kwarg.arg}")
    return f"{name}({', '.join(parts)})"


def _inflect(verb: str) -> str:
    if verb.endswith(("s", "sh", "ch", "x", "z", "o")):
        return verb + "es"
    if verb.endswith("y") and verb[-2:-1] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


def _base_form(word: str) -> str | None:
    """The imperative of a docstring's first word (``Returns`` -> return), or None."""
    word = word.lower()
    candidates = [word]
    if word.endswith("ies"):
        candidates.append(word[:-3] + "y")
    if word.endswith("es"):
        candidates.append(word[:-2])
    if word.endswith("s"):
        candidates.append(word[:-1])
    return next((c for c in candidates if c in VERBS), None)


def summary_forms(docstring: str) -> tuple[str, str] | None:
    """(imperative, third person) of the docstring's first sentence, or None if unusable."""
    paragraph = docstring.strip().split("\n\n")[0]
    sentence = " ".join(paragraph.split())
    if "." in sentence[:-1]:
        cut = re.search(r"\.\s", sentence)
        sentence = sentence[: cut.start() + 1] if cut else sentence
    sentence = sentence.rstrip(".").strip()
    words = sentence.split()
    if not 3 <= len(words) <= 30 or any(c in sentence for c in "`>{}|\\"):
        return None
    base_verb = _base_form(words[0])
    if base_verb is None or not words[0][:1].isupper():
        return None
    base, third = [base_verb], [_inflect(base_verb)]
    if words[1] in ("and", "or") and _base_form(words[2]) is not None:
        # "Remove and return the item": both verbs agree.
        second = _base_form(words[2])
        base += [words[1], second]
        third += [words[1], _inflect(second)]
        words = words[2:]
    rest = words[1:]
    return " ".join(base + rest), " ".join(third + rest)


def _source_of(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
    body = lines[start : node.end_lineno]
    indent = min(len(line) - len(line.lstrip()) for line in body if line.strip())
    return [line[indent:] for line in body]


def _without_docstring(
    lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef
) -> str | None:
    doc = node.body[0]
    if len(node.body) < 2 or doc.lineno == node.lineno:
        return None
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    keep = [
        line
        for number, line in enumerate(lines, start=start)
        if not doc.lineno <= number <= doc.end_lineno
    ]
    return "\n".join(keep)


def extract_functions(path: str, text: str, max_lines: int = 40) -> list[FunctionInfo]:
    """The documented functions and methods of one file that make usable examples."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    source_lines = text.splitlines()
    found: list[FunctionInfo] = []
    candidates = [(node, None) for node in tree.body]
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            candidates += [(child, node.name) for child in node.body]
    for node, cls in candidates:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        docstring = ast.get_docstring(node)
        forms = summary_forms(docstring) if docstring else None
        if forms is None or node.end_lineno - node.lineno >= max_lines:
            continue
        lines = _source_of(source_lines, node)
        found.append(
            FunctionInfo(
                path=path,
                name=node.name,
                cls=cls,
                signature=format_signature(node.name, node.args),
                source="\n".join(lines),
                code_without_docstring=_without_docstring(lines, node),
                base=forms[0],
                third=forms[1],
            )
        )
    return found


def _rng(*key: str) -> random.Random:
    return random.Random(hashlib.sha1("\0".join(key).encode()).hexdigest())


def write_request(fn: FunctionInfo, rng: random.Random) -> list[Message]:
    """A "write this function" exchange; the answer is the source in a python fence."""
    if fn.cls is not None:
        template = rng.choice(WRITE_METHOD)
    elif rng.random() < 0.25:
        template = rng.choice(WRITE_UNNAMED)
    else:
        template = rng.choice(WRITE_NAMED)
    request = template.format(sig=fn.signature, cls=fn.cls, base=fn.base, third=fn.third)
    return [
        {"role": "user", "content": request},
        {"role": "assistant", "content": f"```python\n{fn.source}\n```"},
    ]


def explain_request(fn: FunctionInfo, rng: random.Random) -> list[Message]:
    """A "what does this do" exchange over the source without its docstring."""
    assert fn.code_without_docstring is not None
    request = rng.choice(EXPLAIN).format(code=fn.code_without_docstring)
    answer = f"It {fn.third}." if rng.random() < 0.5 else f"{fn.base[:1].upper()}{fn.base[1:]}."
    return [{"role": "user", "content": request}, {"role": "assistant", "content": answer}]


def training_conversations(
    documents: dict[str, str], seed: int = 0, small_talk_copies: int = 20
) -> list[list[Message]]:
    """Conversations from every usable function of the documents, plus the small talk.

    Each function gives a write request; short ones also an explanation request
    (half of the time). One conversation in ten has a system prompt; one in ten
    is two exchanges long.
    """
    exchanges: list[list[Message]] = []
    for path in sorted(documents):
        for fn in extract_functions(path, documents[path]):
            rng = _rng(str(seed), path, fn.cls or "", fn.name)
            exchanges.append(write_request(fn, rng))
            if fn.code_without_docstring is not None and rng.random() < 0.5:
                exchanges.append(explain_request(fn, rng))
    for _ in range(small_talk_copies):
        exchanges += [
            [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            for q, a in SMALL_TALK
        ]
    rng = random.Random(seed)
    rng.shuffle(exchanges)
    conversations: list[list[Message]] = []
    i = 0
    while i < len(exchanges):
        conversation = list(exchanges[i])
        i += 1
        if rng.random() < 0.1 and i < len(exchanges):
            conversation += exchanges[i]
            i += 1
        if rng.random() < 0.1:
            conversation.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        conversations.append(conversation)
    return conversations


def heldout_prompts(documents: dict[str, str], seed: int = 0) -> list[dict]:
    """One write request per usable function of the held-out documents.

    Each record: ``messages`` (the user turn only), ``reference`` (the answer
    the function's source gives) and ``source`` (file and function).
    """
    records = []
    for path in sorted(documents):
        for fn in extract_functions(path, documents[path]):
            rng = _rng(str(seed), "heldout", path, fn.cls or "", fn.name)
            user, answer = write_request(fn, rng)
            records.append(
                {
                    "source": f"{path}:{fn.cls + '.' if fn.cls else ''}{fn.name}",
                    "messages": [user],
                    "reference": answer["content"],
                }
            )
    return records
