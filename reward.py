"""Tasks and verifiable rewards: reasoning-gym datasets scored by their own scorers.

A `TaskMix` interleaves several reasoning-gym datasets (procedurally generated, each with
its own `score_answer`). The policy answers inside `<answer>...</answer>`; the reward is
binary: 1.0 when reasoning-gym scores the text inside the last answer tags at >= 1.0,
else 0.0. reasoning-gym gives partial credit (a substring of the gold answer scores
len(gold)/len(answer)); that is not a reward here, since a partly right number is wrong.

Seeds: item i of a reasoning-gym dataset with seed s equals item i-1 with seed s+1, so
train and eval seeds must lie further apart than the train size; `TaskMix.exclude`
drops eval items whose question also appears in training.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import reasoning_gym

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
CORRECT_SCORE = 1.0  # reasoning-gym's score for an exact answer; anything less is partial credit


@dataclass(frozen=True)
class Item:
    question: str
    answer: str
    task: int  # index into the mix's datasets
    index: int  # index within that dataset


class TaskMix:
    """Round-robin mix of reasoning-gym datasets: item i comes from dataset i % num_tasks.

    specs: list of (dataset name, kwargs) for `reasoning_gym.create_dataset`.
    Raises ValueError on an empty spec list or an unknown dataset name.
    """

    def __init__(self, specs: list[tuple[str, dict]], *, seed: int, size: int):
        if not specs:
            raise ValueError("TaskMix needs at least one (name, kwargs) spec")
        per_task = -(-size // len(specs))
        self.datasets = []
        for name, kwargs in specs:
            try:
                self.datasets.append(reasoning_gym.create_dataset(name, seed=seed, size=per_task, **kwargs))
            except KeyError as e:
                raise ValueError(f"unknown reasoning-gym dataset {name!r}") from e
        self.items = []
        for i in range(size):
            t, j = i % len(specs), i // len(specs)
            entry = self.datasets[t][j]
            self.items.append(Item(entry["question"], str(entry["answer"]), t, j))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i: int) -> Item:
        return self.items[i]

    def exclude(self, questions: set[str]) -> list[Item]:
        """This mix's items whose question is not in `questions` (eval de-duplication)."""
        return [it for it in self.items if it.question not in questions]

    def score(self, completion: str, item: Item) -> float:
        """Binary reward: 1.0 iff the scorer gives the last <answer> span full marks."""
        found = ANSWER_RE.findall(completion)
        if not found:
            return 0.0
        ds = self.datasets[item.task]
        score = ds.score_answer(found[-1].strip(), ds[item.index])
        return 1.0 if score >= CORRECT_SCORE else 0.0


def demonstration(item: Item) -> str:
    """The completion an SFT warm-up imitates: the gold answer in answer tags."""
    return f"<answer>{item.answer}</answer>"
