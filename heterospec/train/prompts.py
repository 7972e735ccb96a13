"""Training prompts for the draft, disjoint from every benchmark set in ``heterospec.datasets``.

Sources (all built at run time; nothing generated is committed):

==========  =============================================================  ====================
source      what                                                           licence
==========  =============================================================  ====================
instruct    our own instruction templates (writing, roleplay, reasoning,   ours (this repo)
            math, coding, extraction, STEM, humanities, advice) filled
            with our own topic lists in this file
code        code tasks built from docstrings of public functions in the   PSF (stdlib source)
            Python standard library source on this machine (parsed with
            ``ast``, never imported)
docs        explain / summarize / question tasks over python3.11-doc       PSF (Debian
            passages from the *train* split only (``datasets.doc_split``)   python3.11-doc)
math        arithmetic word problems from our own templates (not           ours
            reasoning-gym's gsm_symbolic, which feeds the gsm benchmark)
chat        user turns of the English ChatterBot dialog corpus (chit-chat,  BSD-3-Clause
            tech support, coding, trivia, science, history, literature,     (PyPI
            psychology, money, ...), read from the PyPI wheel               chatterbot-corpus
            ``chatterbot-corpus`` (fetched into the heterospec cache by     1.3.3)
            ``heterospec.fetch``, never installed)
==========  =============================================================  ====================

``SOURCE_INFO`` holds the same facts (what, licence, origin) for ``training_info.json``.
``DISTILL_MIX`` / ``DISTILL_NUM_PROMPTS`` are the settings of the large self-distillation run
(issue 11: >= 2.5M response tokens); ``DEFAULT_MIX`` stays the mix of the shipped draft's data,
because ``calibration_prompts`` is drawn from it (changing it would change the calibration
split). Before distillation the prompts pass ``heterospec.train.disjoint`` (exact and word
8-gram near-duplicate removal against the five benchmark sets and the calibration split).

Disjointness with the benchmarks: MT-bench questions, HumanEval, FastChat's dummy
conversations and GSM-Symbolic are never read here; the python docs are split per file by a
fixed hash (eval files feed the cnndm stand-in only). ``tests/test_train.py`` checks both.

``build_training_prompts(n, seed)`` returns a deterministic, source-interleaved list; the mix
is ``DEFAULT_MIX`` unless given. Missing optional sources (python3.11-doc) are skipped with a
warning and their share goes to the others.
"""

from __future__ import annotations

import ast
import random
import sysconfig
import warnings
from pathlib import Path

from ..datasets import MissingDataError, Prompt, doc_files, doc_passages, doc_sources_root, doc_split

__all__ = ["build_training_prompts", "calibration_prompts", "DEFAULT_MIX", "DISTILL_MIX",
           "DISTILL_NUM_PROMPTS", "SOURCES", "SOURCE_INFO", "source_info", "chat_corpus_dir"]

DEFAULT_MIX = {"instruct": 0.45, "code": 0.2, "docs": 0.15, "math": 0.2}

#: Mix of the large distillation run (the chat source runs out after its ~1-2K distinct user
#: turns; its remaining share then goes to the others).
DISTILL_MIX = {"instruct": 0.4, "code": 0.17, "docs": 0.15, "math": 0.13, "chat": 0.15}
#: Prompts of the large run: the shipped draft's data averaged ~150-200 response tokens per
#: prompt at max_new_tokens 320, so 16,000 prompts give ~2.5-3M response tokens.
DISTILL_NUM_PROMPTS = 16000

SOURCE_INFO = {
    "instruct": {"what": "instruction templates (writing, roleplay, reasoning, math, coding, "
                         "extraction, STEM, humanities, advice) filled from topic lists",
                 "licence": "this repository's licence (our own text)",
                 "origin": "heterospec/train/prompts.py"},
    "code": {"what": "code tasks from docstrings of public Python standard-library functions",
             "licence": "PSF-2.0 (CPython standard library source)",
             "origin": "the Python stdlib on the generating machine (parsed with ast)"},
    "docs": {"what": "explain / summarise / question tasks over Python documentation passages "
                     "(train split of files only)",
             "licence": "PSF-2.0 (Python documentation)",
             "origin": "Debian package python3.11-doc"},
    "math": {"what": "arithmetic word problems from our own templates",
             "licence": "this repository's licence (our own text)",
             "origin": "heterospec/train/prompts.py"},
    "chat": {"what": "user turns of the English ChatterBot dialog corpus",
             "licence": "BSD-3-Clause (PyPI classifier 'License :: OSI Approved :: BSD License'; "
                        "upstream gunthercox/chatterbot-corpus LICENSE)",
             "origin": "PyPI wheel chatterbot-corpus==1.3.3, chatterbot_corpus/data/english/*.yml"},
}


def source_info(names) -> dict:
    """``SOURCE_INFO`` of the named sources (for manifests and ``training_info.json``)."""
    return {n: SOURCE_INFO.get(n, {"what": n, "licence": "unknown", "origin": "unknown"})
            for n in sorted(set(names))}

# ----------------------------------------------------------------------------- instruct

TOPICS = [
    "volcanoes", "the water cycle", "honeybees", "black holes", "the printing press",
    "photosynthesis", "the Roman Empire", "jazz music", "electric cars", "coral reefs",
    "machine learning", "the stock market", "vaccines", "the moon landing", "chess",
    "climate change", "ancient Egypt", "renewable energy", "the human heart", "rainforests",
    "the internet", "democracy", "earthquakes", "coffee", "the Olympic Games", "bicycles",
    "the Renaissance", "DNA", "recycling", "sleep", "meditation", "public libraries",
    "the French Revolution", "antibiotics", "solar panels", "penguins", "the Silk Road",
    "cryptography", "urban gardening", "the immune system", "tea ceremonies", "glaciers",
    "the Industrial Revolution", "smartphones", "bread baking", "marathon running",
    "the periodic table", "whales", "origami", "space telescopes", "the Great Wall of China",
    "social media", "nuclear power", "octopuses", "board games", "hiking", "inflation",
    "the theory of evolution", "wind turbines", "ballet", "3D printing", "the ocean tides",
    "video games", "the Amazon river", "composting", "quantum computers", "friendship",
    "remote work", "the Eiffel Tower", "dinosaurs", "language learning", "cloud computing",
    "time management", "street food", "lighthouses", "the violin", "tornadoes",
    "the history of money", "open source software", "mountain climbing", "saving money",
    "plate tectonics", "the Moon", "Mars exploration", "kindness", "traffic jams",
    "birdwatching", "the Nile", "robots", "volunteering", "electricity", "camping",
    "public transport", "photography", "the Vikings", "trees in cities", "chocolate",
    "first aid", "the alphabet", "rivers", "minimalism", "team sports", "pottery",
]

PEOPLE = [
    "a pirate captain", "a medieval knight", "a detective", "a tour guide", "a chef",
    "a science teacher", "an astronaut", "a museum curator", "a football coach", "a librarian",
    "a travel agent", "a park ranger", "a fitness trainer", "a news reporter", "a poet",
]

AUDIENCES = ["a five-year-old", "a high school student", "a busy manager", "my grandmother",
             "a software engineer", "a tourist", "a new employee"]

FORMS = ["short poem", "haiku", "limerick", "short story", "blog post", "persuasive essay",
         "product description", "speech", "diary entry", "news article", "letter to a friend",
         "song chorus", "dialogue between two friends", "motivational message"]

INSTRUCT_TEMPLATES = [
    "Write a {form} about {topic}.",
    "Write a {form} about {topic} for {audience}.",
    "Explain {topic} to {audience}.",
    "What are the main advantages and disadvantages of {topic}?",
    "Give me five interesting facts about {topic}.",
    "Summarize the history of {topic} in a few paragraphs.",
    "Compare {topic} and {topic2}. How are they similar and how are they different?",
    "Pretend you are {person}. Describe your typical day.",
    "You are {person}. Explain {topic} in your own style.",
    "Act as {person} and give advice to someone who is nervous about their first day at work.",
    "Create a lesson plan for teaching {topic} to {audience}.",
    "List the steps someone should follow to get started with {topic}.",
    "What are common misconceptions about {topic}?",
    "Write an outline for a presentation on {topic}.",
    "Draft a polite email to a colleague asking for help with a project about {topic}.",
    "Suggest three creative names for a company related to {topic}, and explain each.",
    "Why is {topic} important? Answer in three short paragraphs.",
    "Write a short quiz with four questions about {topic}, with answers.",
    "Describe {topic} using a simple analogy.",
    "What might {topic} look like fifty years from now?",
    "Give me a weekly plan to learn more about {topic}.",
    "Write a product review of a book about {topic}.",
    "What questions would you ask an expert on {topic}?",
    "Rewrite the following sentence to be more formal: \"{topic} is super cool and everyone should check it out.\"",
    "Write a tweet announcing a new documentary about {topic}.",
    "Describe a debate between {person} and {person2} about {topic}.",
    "What ethical questions does {topic} raise?",
    "Explain how {topic} affects everyday life.",
]

EXTRACTION_TEMPLATES = [
    "Extract all the numbers from the following text and list them:\n{text}",
    "Identify the names of people and places in this text:\n{text}",
    "Classify the sentiment of each sentence below as positive, negative or neutral:\n{text}",
    "Turn the following notes into a JSON object with keys name, age and city:\n{text}",
    "Find the main idea of the following paragraph and state it in one sentence:\n{text}",
]

NAMES = ["Alice", "Bob", "Carlos", "Diana", "Emeka", "Fatima", "Gustav", "Hana", "Ivan", "Julia",
         "Kenji", "Laila", "Mateo", "Nora", "Omar", "Priya", "Quentin", "Rosa", "Sven", "Tara"]
CITIES = ["Lisbon", "Nairobi", "Osaka", "Toronto", "Lima", "Oslo", "Cairo", "Hanoi", "Denver",
          "Krakow", "Perth", "Dublin", "Seville", "Manila", "Quito"]
FEELINGS = [("loved", "positive"), ("hated", "negative"), ("did not mind", "neutral"),
            ("was thrilled by", "positive"), ("was disappointed by", "negative")]

REASONING_TEMPLATES = [
    "{a} is taller than {b}, and {b} is taller than {c}. Who is the shortest? Explain your reasoning.",
    "If all {x}s are {y}s and some {y}s are red, can we conclude that some {x}s are red? Explain.",
    "{a} has {n} apples. She gives half to {b} and then buys {m} more. How many apples does {a} have now?",
    "A train leaves {city} at {h}:00 and travels for {n} hours. At what time does it arrive?",
    "I have {n} coins, all of them either 5-cent or 10-cent coins, worth {v} cents in total. How many of each do I have?",
    "What comes next in the sequence {s}? Explain the pattern.",
    "{a}, {b} and {c} sit in a row. {a} is not at either end. {b} is to the left of {a}. Who sits on the right end?",
    "Is the following argument valid? \"Every {x} can swim. {a} is a {x}. Therefore {a} can swim.\"",
]

CODING_TEMPLATES = [
    "Write a Python function that {task}.",
    "Write a Python function that {task}. Include a docstring and two examples.",
    "Implement a function in JavaScript that {task}.",
    "Explain step by step how you would write a program that {task}.",
    "Write a C function that {task}.",
    "Write a Python class that {cls}.",
    "What is the time complexity of a function that {task}? Explain.",
    "Write unit tests in Python for a function that {task}.",
]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the vowels in a string", "merges two sorted lists", "removes duplicates from a list",
    "finds the largest element of a list", "computes the factorial of a number",
    "checks whether a string is a palindrome", "flattens a nested list",
    "counts word frequencies in a text", "converts Celsius to Fahrenheit",
    "finds the greatest common divisor of two numbers", "sorts a list of dictionaries by a key",
    "returns the second largest number in a list", "validates an email address",
    "computes the average of a list of numbers", "transposes a matrix",
    "finds all pairs in a list that sum to a target", "capitalizes the first letter of each word",
    "checks if two strings are anagrams", "computes the running total of a list",
    "converts a binary string to an integer", "finds the longest word in a sentence",
    "rotates a list by k positions", "groups a list of words by their first letter",
]

CODE_CLASSES = [
    "implements a simple stack", "models a bank account with deposit and withdraw",
    "represents a 2D point with a distance method", "implements a queue using two stacks",
    "stores a to-do list", "represents a rectangle with area and perimeter methods",
    "implements a least-recently-used cache", "counts how many times each item was added",
]

STEM_TEMPLATES = [
    "How does {sci} work?",
    "Explain the difference between {sci} and {sci2}.",
    "What experiments could a student do at home to learn about {sci}?",
    "Describe the role of {sci} in modern technology.",
    "What is {sci}? Give a precise definition and an example.",
]

SCIENCE = [
    "gravity", "friction", "osmosis", "magnetism", "electric current", "sound waves",
    "the greenhouse effect", "chemical bonds", "cell division", "refraction of light",
    "buoyancy", "kinetic energy", "acids and bases", "the nervous system", "radioactivity",
    "static electricity", "evaporation", "enzymes", "the speed of light", "heat conduction",
]

HUMANITIES_TEMPLATES = [
    "What were the main causes and consequences of {event}?",
    "How did {event} change everyday life for ordinary people?",
    "Discuss the legacy of {event} in two or three paragraphs.",
    "Write a short essay on what we can learn today from {event}.",
]

EVENTS = [
    "the invention of writing", "the fall of the Western Roman Empire", "the Black Death",
    "the age of exploration", "the invention of the steam engine", "the abolition of slavery",
    "the spread of railways", "the invention of the telephone", "the first world war",
    "the founding of the United Nations", "the invention of the printing press",
    "the agricultural revolution", "the end of the Cold War", "the invention of vaccines",
]


def _fill(tmpl: str, rng: random.Random) -> str:
    t1, t2 = rng.sample(TOPICS, 2)
    p1, p2 = rng.sample(PEOPLE, 2)
    return tmpl.format(topic=t1, topic2=t2, person=p1, person2=p2,
                       audience=rng.choice(AUDIENCES), form=rng.choice(FORMS))


def _extraction_text(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(2, 4)):
        name, city = rng.choice(NAMES), rng.choice(CITIES)
        feel, _ = rng.choice(FEELINGS)
        topic = rng.choice(TOPICS)
        lines.append(f"{name}, who is {rng.randint(18, 80)} years old and lives in {city}, "
                     f"{feel} the new exhibition about {topic} and paid {rng.randint(5, 60)} euros.")
    return " ".join(lines)


def _reasoning(rng: random.Random) -> str:
    a, b, c = rng.sample(NAMES, 3)
    n = rng.randint(4, 40) * 2
    start, step = rng.randint(1, 9), rng.randint(2, 7)
    kind = rng.choice(["add", "mul", "sq"])
    if kind == "add":
        seq = [start + step * i for i in range(5)]
    elif kind == "mul":
        seq = [start * step ** i for i in range(5)]
    else:
        seq = [(start + i) ** 2 for i in range(5)]
    tens = rng.randint(1, n // 2)
    return rng.choice(REASONING_TEMPLATES).format(
        a=a, b=b, c=c, n=n, m=rng.randint(1, 9), x=rng.choice(["cat", "robot", "bird", "dog"]),
        y=rng.choice(["animal", "machine", "pet", "friend"]), city=rng.choice(CITIES),
        h=rng.randint(1, 11), s=", ".join(map(str, seq)) + ", ...",
        v=tens * 10 + (n - tens) * 5)


def _instruct_prompts(n: int, rng: random.Random) -> list[Prompt]:
    kinds = ["general"] * 8 + ["extraction", "reasoning", "coding", "stem", "humanities"] * 2
    out = []
    for i in range(n):
        k = rng.choice(kinds)
        if k == "general":
            text = _fill(rng.choice(INSTRUCT_TEMPLATES), rng)
        elif k == "extraction":
            text = rng.choice(EXTRACTION_TEMPLATES).format(text=_extraction_text(rng))
        elif k == "reasoning":
            text = _reasoning(rng)
        elif k == "coding":
            text = rng.choice(CODING_TEMPLATES).format(task=rng.choice(CODE_TASKS),
                                                       cls=rng.choice(CODE_CLASSES))
        elif k == "stem":
            s1, s2 = rng.sample(SCIENCE, 2)
            text = rng.choice(STEM_TEMPLATES).format(sci=s1, sci2=s2)
        else:
            text = rng.choice(HUMANITIES_TEMPLATES).format(event=rng.choice(EVENTS))
        out.append(Prompt(id=f"instruct/{k}/{i}", text=text, source=f"instruct:{k}"))
    return out


# ----------------------------------------------------------------------------- math

ITEMS = [("apples", 0.5), ("notebooks", 2.25), ("pencils", 0.75), ("tickets", 12.0),
         ("cupcakes", 1.5), ("plants", 4.0), ("books", 8.5), ("marbles", 0.1)]

MATH_TEMPLATES = [
    lambda r, a, b, c, it, p, nm: (f"{nm} buys {a} {it} at ${p:.2f} each and {b} more the next day. "
                                   f"How much does {nm} spend in total?"),
    lambda r, a, b, c, it, p, nm: (f"A school has {a * 10} students. {b * 5}% of them walk to school "
                                   f"and the rest take the bus. How many students take the bus?"),
    lambda r, a, b, c, it, p, nm: (f"{nm} reads {a} pages every weekday and {b} pages on each day of "
                                   f"the weekend. How many pages does {nm} read in {c} weeks?"),
    lambda r, a, b, c, it, p, nm: (f"A rectangle is {a} cm long and {b} cm wide. What are its area "
                                   f"and its perimeter?"),
    lambda r, a, b, c, it, p, nm: (f"A car travels {a * 10} km in {b} hours. At the same speed, how "
                                   f"far will it travel in {b + c} hours?"),
    lambda r, a, b, c, it, p, nm: (f"{nm} had {a + b + c} {it}. {nm} gave {a} to a friend and sold "
                                   f"{b}. How many {it} are left?"),
    lambda r, a, b, c, it, p, nm: (f"The price of a jacket is ${a * 10}. It is on sale for {b * 5}% "
                                   f"off. What is the sale price?"),
    lambda r, a, b, c, it, p, nm: (f"A tank holds {a * 100} liters. It is filled at {b * 5} liters per "
                                   f"minute. How many minutes does it take to fill the tank from empty?"),
    lambda r, a, b, c, it, p, nm: f"What is {a * 13} multiplied by {b + 7}? Show your work.",
    lambda r, a, b, c, it, p, nm: (f"Solve for x: {a}x + {b} = {a * c + b}. Explain each step."),
    lambda r, a, b, c, it, p, nm: (f"The average of three numbers is {a + b}. Two of them are {a} and "
                                   f"{b}. What is the third number?"),
    lambda r, a, b, c, it, p, nm: (f"{nm} saves ${a} each week. How many weeks will it take to save "
                                   f"${a * (b + c)}?"),
]


def _math_prompts(n: int, rng: random.Random) -> list[Prompt]:
    out = []
    for i in range(n):
        t = rng.randrange(len(MATH_TEMPLATES))
        it, p = rng.choice(ITEMS)
        text = MATH_TEMPLATES[t](rng, rng.randint(2, 15), rng.randint(2, 12), rng.randint(2, 6),
                                 it, p, rng.choice(NAMES))
        if rng.random() < 0.5:
            text += " Think step by step."
        out.append(Prompt(id=f"math/{t}/{i}", text=text, source="math"))
    return out


# ----------------------------------------------------------------------------- code (stdlib)

_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages",
              "turtledemo", "ensurepip", "__pycache__", "config-3.11-x86_64-linux-gnu", "tkinter",
              "pydoc_data", "unittest"}

CODE_TEMPLATES = [
    "Write a Python function `{name}{sig}` that does the following:\n\n{doc}",
    "Implement this Python function:\n\n```python\ndef {name}{sig}:\n    \"\"\"{doc}\"\"\"\n```",
    "Complete the following Python code:\n\n```python\ndef {name}{sig}:\n    \"\"\"{doc}\"\"\"\n",
    "Explain what a Python function with this description does, then write it:\n\n{doc}",
]


def _stdlib_functions(max_files: int | None = None) -> list[tuple[str, str, str, str]]:
    """(module path, name, signature, first docstring paragraph) of public stdlib functions."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    files = sorted(p for p in root.rglob("*.py")
                   if not (set(p.relative_to(root).parts[:-1]) & _SKIP_DIRS)
                   and not p.name.startswith(("test_", "_")))
    for path in files[:max_files]:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            para = doc.strip().split("\n\n")[0].strip()
            if not (60 <= len(para) <= 600) or ">>>" in para:
                continue
            args = node.args
            if args.args and args.args[0].arg in ("self", "cls"):
                continue  # methods need their class for context
            try:
                sig = "(" + ast.unparse(args) + ")"
            except Exception:  # pragma: no cover - ast.unparse handles all valid code
                continue
            if len(sig) > 80:
                continue
            found.append((str(path.relative_to(root)), node.name, sig, para))
    return found


def _code_prompts(n: int, rng: random.Random, max_files: int | None = None) -> list[Prompt]:
    funcs = _stdlib_functions(max_files)
    rng.shuffle(funcs)
    out = []
    for i in range(n):
        mod, name, sig, doc = funcs[i % len(funcs)]
        t = rng.randrange(len(CODE_TEMPLATES))
        text = CODE_TEMPLATES[t].format(name=name, sig=sig, doc=doc)
        out.append(Prompt(id=f"code/{mod}:{name}/{i}", text=text, source="code:stdlib"))
    return out


# ----------------------------------------------------------------------------- docs (train split)

DOC_TEMPLATES = [
    "Summarize the following passage in a few sentences:\n\n{p}",
    "Explain the following documentation to a beginner:\n\n{p}",
    "Write three questions a student could answer after reading this text:\n\n{p}",
    "What are the key points of this text? Use a bulleted list.\n\n{p}",
    "Rewrite the following text in simpler words:\n\n{p}",
    "Give a one-paragraph summary of this text:\n\n{p}",
]


def train_doc_passages() -> list[tuple[str, int, str]]:
    """(file, index, passage) for every passage of the *train* split of python3.11-doc."""
    root = doc_sources_root()
    out = []
    for rel in doc_files(root):
        if doc_split(rel) == "train":
            out.extend((rel, j, p) for j, p in enumerate(doc_passages(rel, root, min_words=60,
                                                                        max_words=250)))
    return out


def _docs_prompts(n: int, rng: random.Random) -> list[Prompt]:
    cands = train_doc_passages()
    rng.shuffle(cands)
    out = []
    for i in range(min(n, len(cands))):
        rel, j, p = cands[i]
        out.append(Prompt(id=f"docs/{rel}#{j}", text=rng.choice(DOC_TEMPLATES).format(p=p),
                          source="docs:train"))
    return out


# ----------------------------------------------------------------------------- chat (ChatterBot)

CHAT_PACKAGE = "chatterbot_corpus"


def chat_corpus_dir() -> Path:
    """``chatterbot_corpus/data/english`` of the installed or cached wheel (fetched on first use
    unless ``HETEROSPEC_NO_FETCH=1``); ``MissingDataError`` naming the fetch command otherwise."""
    from ..fetch import package_dirs

    for d in package_dirs(CHAT_PACKAGE, error=MissingDataError):
        eng = Path(d) / "data" / "english"
        if eng.is_dir():
            return eng
    raise MissingDataError(f"{CHAT_PACKAGE}: no data/english directory; run: heterospec fetch train")


def chat_user_turns(root: Path | None = None) -> list[tuple[str, int, str]]:
    """(file stem, index, text) of the distinct user turns (even positions of each conversation)
    of the English ChatterBot corpus, in file order; turns of fewer than 3 words are skipped."""
    try:
        import yaml
    except ImportError as exc:  # pragma: no cover - PyYAML comes with transformers
        raise MissingDataError("reading the ChatterBot corpus needs PyYAML: pip install pyyaml") from exc
    root = chat_corpus_dir() if root is None else Path(root)
    out, seen = [], set()
    for path in sorted(root.glob("*.yml")):
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for conv in doc.get("conversations") or []:
            if not isinstance(conv, list):
                continue
            for t, turn in enumerate(conv):
                if t % 2 or not isinstance(turn, str):
                    continue
                text = " ".join(turn.split())
                if len(text.split()) < 3 or text.lower() in seen:
                    continue
                seen.add(text.lower())
                out.append((path.stem, len(out), text))
    return out


def _chat_prompts(n: int, rng: random.Random) -> list[Prompt]:
    turns = chat_user_turns()
    rng.shuffle(turns)
    return [Prompt(id=f"chat/{stem}/{j}", text=text, source="chat:chatterbot")
            for stem, j, text in turns[:n]]


SOURCES = {"instruct": _instruct_prompts, "code": _code_prompts, "docs": _docs_prompts,
           "math": _math_prompts, "chat": _chat_prompts}


def build_training_prompts(n: int = 6000, seed: int = 0,
                           mix: dict[str, float] | None = None) -> list[Prompt]:
    """``n`` training prompts, deterministic in (n, seed, mix), sources interleaved so that any
    prefix of the list has about the requested mix."""
    mix = dict(DEFAULT_MIX if mix is None else mix)
    per_source: dict[str, list[Prompt]] = {}
    total_w = sum(mix.values())
    for name in sorted(mix):
        k = int(round(n * mix[name] / total_w)) + 1
        try:
            per_source[name] = SOURCES[name](k, random.Random(f"heterospec-train-{name}-{seed}"))
        except MissingDataError as exc:
            warnings.warn(f"training prompt source {name!r} skipped: {exc}")
    # interleave by weight (deterministic smooth round robin), then dedupe by text
    weights = {k: mix[k] for k in per_source if per_source[k]}
    credit = {k: 0.0 for k in weights}
    idx = {k: 0 for k in weights}
    out, seen = [], set()
    while len(out) < n and weights:
        for k in credit:
            credit[k] += weights[k]
        k = max(credit, key=lambda s: (credit[s], s))
        credit[k] -= sum(weights.values())
        if idx[k] >= len(per_source[k]):
            del weights[k], credit[k]
            continue
        p = per_source[k][idx[k]]
        idx[k] += 1
        if p.text not in seen:
            seen.add(p.text)
            out.append(p)
    return out


def calibration_prompts(n: int = 64, seed: int = 0,
                        train_prompts: int = 4800) -> tuple[list[str], str]:
    """Prompts for ``heterospec calibrate`` (entropy-bin fitting): the same sources and mix as
    the training prompts, drawn with a different seed and de-duplicated against the first
    ``train_prompts`` training prompts (seed 0, the shipped draft's set), so they are disjoint
    from both the draft's training data and every benchmark set. Returns (texts, source label)."""
    train = {p.text for p in build_training_prompts(train_prompts, seed=0)}
    pool = build_training_prompts(4 * n + 64, seed=1_000 + seed)
    texts = [p.text for p in pool if p.text not in train][:n]
    return texts, (f"heterospec.train.prompts calibration split (seed {1_000 + seed}, {len(texts)} "
                   f"prompts, disjoint from the first {train_prompts} training prompts and from "
                   f"the benchmark sets)")
