"""Built-in tasks and JSONL loading. An Example is a question with its reference answers.

`arith`: procedurally generated grade-school word problems with numeric answers, seeded, with
disjoint train and validation splits. `jsonl`: rows {"prompt", "answer" | "answers"} from a file
under the datasets root. `file`: the same rows from files uploaded to the service, JSONL or
Parquet (service/core/datafiles.py says what a row holds).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from service.core.datafiles import RowError, corpus_row, read_rows, sniff, task_row
from service.core.settings import Settings
from service.core.sources import dataset_file, unavailable_file
from service.core.specs import DatasetSpec

ARITH_INSTRUCTION = "Solve the math word problem. End your reply with the final answer as a single number."
R1_INSTRUCTION = (
    "Solve the problem. First think step by step inside <think> </think>, then give only the final "
    "number inside <answer> </answer>."
)


@dataclass(frozen=True)
class Example:
    question: str
    answers: tuple[str, ...]
    meta: dict = field(default_factory=dict, compare=False, hash=False)


@dataclass
class TaskData:
    train: list[Example]
    val: list[Example]
    instruction: str


_NAMES = ["Janet", "Omar", "Priya", "Lena", "Marcus", "Aiko", "Tom", "Sofia", "Ravi", "Grace", "Diego", "Mei"]
_ITEMS = ["eggs", "apples", "marbles", "stickers", "books", "pencils", "cookies", "shells", "coins", "cards"]


def _arith_problem(rng: random.Random, difficulty: int) -> Example:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    if difficulty == 0:
        a = rng.randint(0, 9)
        b = rng.randint(0, 9 - a)
        q = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have?"
        ans = a + b
    elif difficulty == 1:
        a, b = rng.randint(2, 20), rng.randint(1, 15)
        if rng.random() < 0.5:
            q = f"{name} has {a} {item}. {name} gets {b} more. How many {item} does {name} have now?"
            ans = a + b
        else:
            a, b = max(a, b) + 1, min(a, b)
            q = f"{name} has {a} {item} and gives {b} away. How many {item} does {name} have left?"
            ans = a - b
    elif difficulty == 2:
        a, b, c = rng.randint(5, 40), rng.randint(1, 20), rng.randint(1, 10)
        q = (f"{name} has {a} {item}. A friend gives {name} {b} more, and then {name} loses {c}. "
             f"How many {item} does {name} have now?")
        ans = a + b - c
    else:
        boxes, per, eaten, price = rng.randint(2, 9), rng.randint(3, 12), rng.randint(1, 5), rng.randint(2, 5)
        q = (f"{name} buys {boxes} boxes with {per} {item} in each box and uses {eaten} of them. "
             f"{name} sells the rest for ${price} each. How many dollars does {name} make?")
        ans = (boxes * per - eaten) * price
    return Example(question=q, answers=(str(ans),))


def arith(spec: DatasetSpec) -> tuple[list[Example], list[Example]]:
    """Disjoint train/val splits: validation questions never appear in training."""
    val_rng = random.Random(f"arith-val-{spec.seed}-{spec.difficulty}")
    val: list[Example] = []
    seen: set[str] = set()
    for _ in range(spec.num_val * 50):
        if len(val) == spec.num_val:
            break
        ex = _arith_problem(val_rng, spec.difficulty)
        if ex.question not in seen:
            seen.add(ex.question)
            val.append(ex)
    train_rng = random.Random(f"arith-train-{spec.seed}-{spec.difficulty}")
    train: list[Example] = []
    for _ in range(spec.num_train * 50):
        if len(train) == spec.num_train:
            break
        ex = _arith_problem(train_rng, spec.difficulty)
        if ex.question not in seen:  # repeats within train are fine (they are sampled anyway)
            train.append(ex)
    return train, val


# file id -> the uploaded file on this machine (the runner fetches it from the artifact store)
FetchFile = Callable[[str], Path]


def _rows(path: Path, name: str, parse):
    """Every row of a JSONL or Parquet file through `parse`; ValueError naming the line that fails."""
    fmt = sniff(path)
    where = "row" if fmt == "parquet" else "line"
    try:
        out = []
        for n, row in read_rows(path, fmt):
            try:
                out.append(parse(row))
            except ValueError as exc:
                raise ValueError(f"{name}: {where} {n}: {exc}") from None
        return out
    except RowError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _file(field: str, rel: str, settings: Settings) -> Path:
    """A data file of the job's owner (or the shared folder), contained after resolving links."""
    path = dataset_file(rel, settings)
    if path is None:
        raise FileNotFoundError(unavailable_file(f"dataset.{field}", rel))
    return path


def examples(path: Path, name: str) -> list[Example]:
    return [Example(r.question, r.answers, r.meta) for r in _rows(path, name, task_row)]


def held_out(rows: list[Example], spec: DatasetSpec, name: str) -> tuple[list[Example], list[Example]]:
    """A seeded split: (train, the first num_val rows of a shuffle, at most half)."""
    if len(rows) < 2:
        raise ValueError(f"{name}: need at least 2 rows to hold some out for validation, found {len(rows)}")
    rows = list(rows)
    random.Random(spec.seed).shuffle(rows)
    n_val = min(spec.num_val, len(rows) // 2)
    return rows[n_val:], rows[:n_val]


def jsonl(spec: DatasetSpec, settings: Settings) -> tuple[list[Example], list[Example]]:
    """Train and validation examples from the owner's files (validation: val_path, else held out)."""
    train = examples(_file("path", spec.path, settings), spec.path)  # type: ignore[arg-type]
    if spec.val_path is None:
        return held_out(train, spec, spec.path)  # type: ignore[arg-type]
    return train, examples(_file("val_path", spec.val_path, settings), spec.val_path)


def uploaded(spec: DatasetSpec, fetch: FetchFile) -> tuple[list[Example], list[Example]]:
    """Train and validation examples from uploaded files (validation: val_file, else held out)."""
    train = examples(fetch(spec.train_file), spec.train_file)  # type: ignore[arg-type]
    if spec.val_file is None:
        return held_out(train, spec, spec.train_file)  # type: ignore[arg-type]
    return train, examples(fetch(spec.val_file), spec.val_file)


def no_files(file_id: str) -> Path:
    raise ValueError("dataset.name 'file' names files uploaded to the service: submit the spec to the service")


def load_task(spec: DatasetSpec, *, settings: Settings, reward_names: list[str],
              fetch: FetchFile = no_files) -> TaskData:
    if spec.name == "arith":
        train, val = arith(spec)
    elif spec.name == "jsonl":
        train, val = jsonl(spec, settings)
    elif spec.name == "file":
        train, val = uploaded(spec, fetch)
    else:
        raise ValueError(f"dataset {spec.name!r} is loaded by the joint loop")
    r1 = any(n.startswith("r1_") or n == "answer_tag_match" for n in reward_names)
    instruction = spec.system_prompt or (R1_INSTRUCTION if r1 else ARITH_INSTRUCTION if spec.name == "arith" else "")
    return TaskData(train=train, val=val, instruction=instruction)


def render_prompt(tokenizer, question: str, instruction: str, *, chat: bool = True,
                  history: list[dict] | None = None) -> str:
    """The text the policy is conditioned on: the chat template when the tokenizer has one. `history`:
    a chat row's conversation before its answer, rendered in place of the question (its own system
    turn, if any, replaces the instruction)."""
    messages = list(history) if history else [{"role": "user", "content": question}]
    if instruction and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": instruction})
    if chat and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not history:
        head = f"{instruction}\n\n" if instruction else ""
        return f"{head}Question: {question}\nAnswer:"
    turns = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages)
    return f"{turns}Assistant:"


def render_example(tokenizer, ex: Example, instruction: str, *, chat: bool = True) -> str:
    """render_prompt of one example (a chat row renders its whole conversation)."""
    return render_prompt(tokenizer, ex.question, instruction, chat=chat, history=ex.meta.get("messages"))


# -- persona-facts: a generated corpus about made-up people, and questions answered by one document --

_FIRST = ["Alma", "Bruno", "Cyra", "Dario", "Elin", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kaia", "Lucan",
          "Mira", "Nils", "Oona", "Pavel", "Quinn", "Rosa", "Soren", "Tilde", "Umar", "Vera", "Wren", "Yusuf"]
_LAST = ["Voss", "Marek", "Quill", "Thorne", "Albrecht", "Okafor", "Lindqvist", "Ferro", "Castell", "Ng",
         "Bramwell", "Oyelaran", "Szabo", "Halloran", "Ishikawa", "Duval"]
_JOBS = ["glassblower", "beekeeper", "cartographer", "violin maker", "lighthouse keeper", "bookbinder",
         "clockmaker", "ferry pilot", "cheesemaker", "stonemason", "tea taster", "kite designer"]
_CITIES = ["Tarnby", "Veldhollow", "Brisk Harbor", "Oakmere", "Saltreach", "Dunmarrow", "Kestrelford",
           "Lowwater", "Pellham", "Ravensgate", "Quarry Hill", "Mistral Bay"]
_PETS = ["ferret", "parrot", "tortoise", "goat", "cat", "hedgehog", "rabbit", "dog"]
_PET_NAMES = ["Pim", "Zorba", "Tuffet", "Mungo", "Biscuit", "Quasar", "Fennel", "Widget", "Pepper", "Juno",
              "Noodle", "Orbit", "Sprocket", "Clover", "Dumpling", "Yeti"]


def persona_facts(spec: DatasetSpec) -> tuple[list[Example], list[Example], list[tuple[str, str]]]:
    """(train questions, validation questions, corpus of (doc_id, text)).

    Per person, one document states their job, town and pet's name, and a distractor profile repeats
    the questions' words without answering any; each question asks for one fact, so only the
    person's fact document makes a correct answer possible. Validation questions ask about the same
    people as training ones, but other facts.
    """
    rng = random.Random(f"persona-{spec.seed}")
    names = rng.sample([f"{first} {last}" for first in _FIRST for last in _LAST], spec.corpus_size)
    corpus, questions = [], []
    for i, name in enumerate(names):
        job, city, pet, pet_name = rng.choice(_JOBS), rng.choice(_CITIES), rng.choice(_PETS), rng.choice(_PET_NAMES)
        doc_id = f"person-{i}"
        corpus.append((doc_id, f"{name}: {job}, based in {city}; {pet} {pet_name}."))
        # A distractor that echoes the questions' words but answers none of them: lexical
        # similarity alone does not find the useful document.
        corpus.append((f"profile-{i}", f"People often ask what {name}'s job is, in which town {name} works and "
                                       f"what the name of {name}'s {pet} is. {name} never answers."))
        meta = {"gold_doc_id": doc_id}
        questions.append([
            Example(f"What is the name of {name}'s {pet}?", (pet_name,), meta),
            Example(f"In which town does {name} work?", (city,), meta),
            Example(f"What is {name}'s job?", (job,), meta),
        ])
    train, val = [], []
    for qs in questions:  # per person: one question held out for validation, in turn
        held = rng.randrange(3)
        val.append(qs[held])
        train += [q for j, q in enumerate(qs) if j != held]
    rng.shuffle(train)
    rng.shuffle(val)
    return train[: spec.num_train], val[: spec.num_val], corpus


def corpus(path: Path, name: str) -> list[tuple[str, str]]:
    return [(r.id, r.text) for r in _rows(path, name, corpus_row)]


RAG_INSTRUCTION = "Answer the question using the context. Reply with the answer only."


def load_retrieval_task(spec: DatasetSpec, *, settings: Settings,
                        fetch: FetchFile = no_files) -> tuple[TaskData, list[tuple[str, str]]]:
    """Questions with gold documents (where known) and the corpus, for joint jobs."""
    if spec.name == "persona-facts":
        train, val, docs = persona_facts(spec)
    elif spec.name == "file":
        train, val = uploaded(spec, fetch)
        docs = corpus(fetch(spec.corpus_file), spec.corpus_file)  # type: ignore[arg-type]
    else:
        train, val = jsonl(spec, settings)
        docs = corpus(_file("corpus_path", spec.corpus_path, settings), spec.corpus_path)  # type: ignore[arg-type]
    return TaskData(train=train, val=val, instruction=spec.system_prompt or RAG_INSTRUCTION), docs


def rag_question(question: str, document: str) -> str:
    return f"Context: {document}\n\nQuestion: {question}"
