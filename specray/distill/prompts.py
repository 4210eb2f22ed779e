"""The distillation prompt set: diverse, deterministic, written here, and disjoint from the
benchmark prompts (the bench measures held-out acceptance).

Three families mirror what the served model is asked: chat (explain, advise, list, create),
code (write, fix, explain, convert, in several languages) and text work (summarise, extract,
rewrite) over passages the target itself wrote in an earlier generation pass.
"""

from __future__ import annotations

import json
import random
from importlib import resources

TOPICS = (
    "photosynthesis",
    "the water cycle",
    "volcanoes",
    "black holes",
    "the moon's phases",
    "earthquakes",
    "rainbows",
    "tides",
    "vaccines",
    "the immune system",
    "sleep",
    "coffee",
    "honey",
    "bread baking",
    "composting",
    "recycling plastic",
    "electric cars",
    "wind turbines",
    "batteries",
    "the internet",
    "email",
    "passwords",
    "encryption",
    "cloud computing",
    "databases",
    "spreadsheets",
    "budgeting",
    "saving money",
    "job interviews",
    "public speaking",
    "learning a language",
    "playing the guitar",
    "chess",
    "running",
    "yoga",
    "swimming",
    "gardening",
    "houseplants",
    "dogs",
    "cats",
    "birds migrating",
    "bees",
    "ants",
    "whales",
    "forests",
    "deserts",
    "glaciers",
    "oceans",
    "the Roman Empire",
    "ancient Egypt",
    "the printing press",
    "the steam engine",
    "airplanes",
    "trains",
    "bicycles",
    "maps",
    "time zones",
    "calendars",
    "music theory",
    "painting",
    "photography",
    "poetry",
    "museums",
    "libraries",
    "newspapers",
    "video games",
    "board games",
    "cooking pasta",
    "making tea",
    "breakfast",
    "healthy snacks",
    "drinking water",
    "first aid",
    "camping",
    "hiking safety",
    "packing a suitcase",
    "moving house",
    "cleaning a kitchen",
    "laundry",
    "team meetings",
    "remote work",
    "writing a resume",
    "time management",
    "note taking",
    "reading faster",
    "memory",
    "habits",
    "kindness",
    "friendship",
    "teaching children",
    "homework",
    "exams",
    "climate",
    "weather forecasts",
    "snow",
    "lightning",
    "the sun",
    "Mars",
    "satellites",
    "telescopes",
    "microscopes",
    "magnets",
    "electricity",
    "sound",
    "light",
    "gravity",
    "friction",
    "atoms",
    "DNA",
    "bacteria",
    "mushrooms",
    "fruit",
)

CHAT_TEMPLATES = (
    "Explain {topic} in simple terms.",
    "What are the most important facts about {topic}?",
    "Give me three tips related to {topic}.",
    "Why is {topic} important?",
    "Write a short paragraph about {topic}.",
    "Write a haiku about {topic}.",
    "Write a four-line poem about {topic}.",
    "What is a common misconception about {topic}?",
    "How would you explain {topic} to a ten-year-old?",
    "List five questions a student might ask about {topic}.",
    "What are the pros and cons of {topic}?",
    "Tell me a fun fact about {topic}.",
    "Write a short story that involves {topic}.",
    "Describe {topic} in two sentences.",
    "What should a beginner know about {topic}?",
    "Compare {topic} and {other}.",
    "What do {topic} and {other} have in common?",
    "Suggest a title for a blog post about {topic} and explain it.",
    "Write a friendly email inviting a colleague to a talk about {topic}.",
    "Give a step-by-step guide related to {topic}.",
)

PASSAGE_TEMPLATE = "Write a factual paragraph of four sentences about {topic}."

LANGUAGES = ("Python", "JavaScript", "Rust", "Go", "Java", "C", "bash", "SQL", "TypeScript")
CODE_TASKS = (
    "reverses a list",
    "checks whether a number is prime",
    "counts the words in a string",
    "returns the largest of three numbers",
    "computes the factorial of n",
    "merges two sorted lists",
    "removes duplicates from a list",
    "converts Celsius to Fahrenheit",
    "checks whether a string is a palindrome",
    "sums the digits of a number",
    "finds the second largest element of an array",
    "computes the average of a list",
    "reads a file and prints its lines",
    "counts vowels in a string",
    "returns the n-th triangular number",
    "flattens a nested list",
    "capitalises every word",
    "validates an email address roughly",
    "computes the greatest common divisor",
    "implements binary search",
    "sorts a list of names alphabetically",
    "returns the Fibonacci numbers below n",
    "groups words by their first letter",
    "counts how often each character appears",
    "rotates an array by k positions",
)
CODE_TEMPLATES = (
    "Write a {language} function that {task}.",
    "Show me how to write a {language} program that {task}.",
    "Write a {language} function that {task}, with a short comment.",
    "Explain how to write code that {task} in {language}.",
)
SNIPPETS = (
    "def add(a, b):\n    return a - b",
    "total = 0\nfor n in range(10):\n    if n % 2 == 0:\n        total += n\nprint(total)",
    "def first(items):\n    return items[1]",
    "words = text.split()\ncounts = {}\nfor w in words:\n    counts[w] = counts.get(w, 0) + 1",
    "x = [i * 2 for i in range(5)]\nprint(x)",
    "def area(radius):\n    return 3.14 * radius * 2",
    "while True:\n    line = input()\n    if not line:\n        break\n    print(line.upper())",
    "names = ['b', 'a', 'c']\nnames.sort(reverse=True)\nprint(names[0])",
    "def is_odd(n):\n    return n % 2 == 0",
    "for key, value in data.items():\n    print(key, value)",
    "result = sum(x for x in numbers if x > 0)",
    "def average(xs):\n    return sum(xs) / len(xs) + 1",
)
SNIPPET_TEMPLATES = (
    "Explain what this code does:\n\n{snippet}",
    "Find the bug in this code:\n\n{snippet}",
    "Add a docstring to this code:\n\n{snippet}",
    "Rewrite this code to be clearer:\n\n{snippet}",
)
TEXT_TEMPLATES = (
    "Summarise the following text in one sentence:\n\n{passage}",
    "Summarise the following text in two sentences:\n\n{passage}",
    "List the key facts in this text as bullet points:\n\n{passage}",
    "Give this text a short title:\n\n{passage}",
    "Rewrite this text for a child:\n\n{passage}",
    "Write three questions that this text answers:\n\n{passage}",
)


def bench_prompts() -> set[str]:
    text = resources.files("specray.data").joinpath("bench_prompts.json").read_text()
    return {item["prompt"] for item in json.loads(text)["prompts"]}


def _shuffled(items: list[str], seed: int) -> list[str]:
    held_out = bench_prompts()
    unique = sorted({item for item in items if item not in held_out})
    random.Random(seed).shuffle(unique)
    return unique


def chat_and_code_prompts(seed: int) -> list[str]:
    """Every chat and code prompt the templates make (about 3,800), shuffled by ``seed``."""
    prompts = []
    for index, topic in enumerate(TOPICS):
        other = TOPICS[(index * 7 + 3) % len(TOPICS)]
        prompts += [template.format(topic=topic, other=other) for template in CHAT_TEMPLATES]
    for language in LANGUAGES:
        for task in CODE_TASKS:
            prompts += [
                template.format(language=language, task=task) for template in CODE_TEMPLATES
            ]
    for snippet in SNIPPETS:
        prompts += [template.format(snippet=snippet) for template in SNIPPET_TEMPLATES]
    return _shuffled(prompts, seed)


def passage_prompts(seed: int) -> list[str]:
    """Prompts whose answers become the passages of the text-work prompts."""
    return _shuffled([PASSAGE_TEMPLATE.format(topic=topic) for topic in TOPICS], seed)


def text_prompts(passages: list[str], seed: int) -> list[str]:
    """Text-work prompts over passages (the target's own paragraphs)."""
    rng = random.Random(seed)
    return _shuffled(
        [rng.choice(TEXT_TEMPLATES).format(passage=passage.strip()) for passage in passages]
        + [rng.choice(TEXT_TEMPLATES).format(passage=passage.strip()) for passage in passages],
        seed,
    )
