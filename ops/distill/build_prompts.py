"""Build distillation prompts from offline Debian text (see sources.py); never from the evaluation set.

    python -m ops.distill.build_prompts --out .carry/distill/prompts.jsonl.gz --num 60000 --seed 0 \
        [--tokenizer TARGET_FOLDER --tokenized .carry/distill/prompts.npz]

Each output line is {"category": str, "messages": [{"role": "user", "content": ...}, ...],
"followups": [str, ...]}: a chat whose assistant turns the target writes itself, and optional later user
turns asked after the target's own answer (multi-turn data, generated in a second round).

The task mix mirrors what a serving drafter meets (summaries of long passages, questions over retrieved
documents, translation, short factual questions, arithmetic word problems, open writing, role play,
coding, extraction, multi-turn rewriting) with many phrasings per task, so that the drafter learns the
target's behaviour rather than one template. With `--tokenizer`, the chats are also rendered with the
target's chat template and stored as token ids (`.npz`, what the GPU run reads: no tokenizer needed there).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import sys
import time
from pathlib import Path

from ops.distill import sources
from specserve.prompts import SPEC_BENCH_DEV

# Category mix (fractions of prompts).
MIX = {
    "summarization": 0.13,
    "rag": 0.11,
    "translation": 0.11,
    "qa": 0.12,
    "math": 0.13,
    "writing": 0.08,
    "explain": 0.10,
    "roleplay": 0.05,
    "coding": 0.07,
    "extraction": 0.05,
    "reasoning": 0.05,
}
# Decontamination: no template paraphrases a Spec-Bench dev prompt. The shipped drafter's data also came from
# templates that did and that this builder leaves out (drafters/PROVENANCE.md): the follow-ups "Start every
# sentence with the letter A", "only use four-word sentences", "Revise your previous response and add ...",
# "Rewrite it as a limerick", the "travel to N countries" word problem and the "overtake in a race" puzzle.
# `check_overlap` below flags any 8-gram shared with an evaluation file.
FOLLOWUP_FRACTION = 0.35  # of the open-ended categories: ask a second turn after the target's answer

SUMMARY_T = [
    "Summarize: {p}", "Summarize the following text.\n\n{p}", "Summarize: {p}",
    "Summarize this in a few sentences:\n{p}",
    "Write a short summary of the passage below.\n\n{p}", "{p}\n\nSummarize the text above.",
    "TL;DR:\n{p}", "Give me the key points of this text:\n\n{p}", "Summarize: {p}",
    "Please summarize the following article in one paragraph:\n{p}", "Condense this into two or three sentences: {p}",
    "Read the following and write a brief summary.\n{p}", "What is this text about? Summarize it.\n\n{p}",
    "Summarize the main idea of the following passage:\n{p}",
]
RAG_Q = [
    "What is {t}?", "How does {t} work?", "Explain {t} based on the documents.", "What is the purpose of {t}?",
    "According to the passages, what should you know about {t}?", "Why would someone use {t}?",
    "Describe {t}.", "What does the text say about {t}?", "How do you use {t}?", "When is {t} used?",
]
RAG_T = [
    "{docs}\n{q}", "{docs}\n\n{q}", "Answer the question using the documents below.\n\n{docs}\n\nQuestion: {q}",
    "Documents:\n{docs}\n\nBased on the documents above, {ql}", "{docs}\nQuestion: {q}\nAnswer:",
    "Use the following context to answer.\n{docs}\n\n{q}", "Context:\n{docs}\n\nQ: {q}",
]
TRANSLATE_DE_EN = [
    "Translate German to English: {s}", "Translate German to English: {s}", "Translate German to English: {s}",
    "Translate the following German text into English:\n{s}", "Translate to English: {s}",
    "What does this German sentence mean in English? {s}", "German: {s}\nEnglish:",
    "Please translate this from German into English.\n\n{s}",
]
TRANSLATE_EN_X = [
    "Translate English to {lang}: {s}", "Translate the following text into {lang}:\n{s}",
    "How would you say this in {lang}? {s}", "Translate to {lang}: {s}",
]
LANGS = ["German", "French", "Spanish", "Italian", "Portuguese", "Dutch"]
QA_WORD = [
    "What is {w}?", "What does \"{w}\" mean?", "Define {w}.", "What is the meaning of the word {w}?",
    "what is {w}", "Can you explain what {w} is?", "Give an example of {w}.", "Is {w} a noun or a verb?",
    "What is a synonym for {w}?", "Use the word \"{w}\" in a sentence.", "who or what is {w}?",
    "What is the difference between {w} and {w2}?", "How are {w} and {w2} related?",
]
QA_GENERAL = [
    "Who invented the {thing}?", "When was the {thing} invented?", "Where does the word {w} come from?",
    "What is the capital of {country}?", "What language is spoken in {country}?", "How many {unit} are in a {big}?",
    "What is the largest {thing2} in the world?", "Why is the sky blue?", "How do {animal}s sleep?",
    "What do {animal}s eat?", "How long do {animal}s live?", "Who was {person}?", "What is {person} known for?",
    "when did {event} happen", "what is the population of {country}", "How does a {thing} work?",
]
WRITING_T = [
    "Write a blog post about {topic}.", "Compose a short poem about {topic}.", "Write a short story about {topic}.",
    "Write a short story that begins with the sentence: {quote}", "Draft a professional email about {topic}.",
    "Write a persuasive paragraph about {topic}.", "Write a product description for {thing}.",
    "Create an engaging social media post about {topic}.", "Write a haiku about {topic}.",
    "Write a speech for a wedding that mentions {topic}.", "Describe a vivid character who is obsessed with {topic}.",
    "Write a letter to a friend about {topic}.", "Write an outline for an essay on {topic}.",
    "Write a limerick about {topic}.", "Write a news report about {topic}.",
    "Write a motivational message inspired by this quote: {quote}",
]
EXPLAIN_T = [
    "Explain {topic} in simple terms.", "What is {topic} and why does it matter?",
    "Explain {topic} to a ten-year-old.", "Give me an overview of {topic}.",
    "What are the pros and cons of {topic}?", "Describe the history of {topic}.",
    "How would you teach {topic} to a beginner?", "List five interesting facts about {topic}.",
    "Compare {topic} and {topic2}.", "What are common misconceptions about {topic}?",
    "In the field of {field}, what is {topic}?", "How does {topic} affect everyday life?",
]
FIELDS = ["physics", "biology", "economics", "history", "psychology", "computer science", "chemistry", "philosophy",
          "medicine", "sociology", "astronomy", "linguistics", "geography", "mathematics", "music", "art history"]
PERSONAS = ["a pirate captain", "Sherlock Holmes", "a medieval knight", "a friendly robot", "a travel guide in Paris",
            "a grumpy chef", "an astronaut on Mars", "a kindergarten teacher", "a detective in 1920s Chicago",
            "a wise old wizard", "a sports commentator", "a tech startup founder", "a museum curator",
            "a doctor", "a stand-up comedian", "Albert Einstein", "Shakespeare", "a car salesman",
            "a park ranger", "a time traveler from the year 3000", "a cat who can talk", "a news anchor"]
ROLEPLAY_T = [
    "Pretend you are {persona}. {q}", "Act as {persona} and answer: {q}", "You are {persona}. {q}",
    "Imagine you are {persona}. Tell me about {topic}.", "Role-play as {persona} for this conversation. {q}",
    "Embrace the role of {persona}. {q}",
]
ROLEPLAY_Q = ["What do you think about {topic}?", "How was your day?",
              "What is your advice for someone new to {topic}?",
              "Why should I care about {topic}?", "Tell me a story from your life.", "What is your favorite {thing2}?",
              "Describe your typical morning.", "What scares you the most?"]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n", "merges two sorted lists",
    "counts the words in a text file", "finds the largest element in a list", "removes duplicates from a list",
    "checks if a string is a palindrome", "computes the Fibonacci sequence up to n",
    "sorts a list of dictionaries by a key",
    "reads a CSV file and prints the average of a column", "converts Celsius to Fahrenheit", "flattens a nested list",
    "finds the most common word in a text", "computes the greatest common divisor of two numbers",
    "validates an email address with a regular expression", "implements binary search", "transposes a matrix",
    "returns the n largest numbers in a list", "parses a date string and prints the weekday",
    "implements a stack class", "counts vowels in a string", "checks if two strings are anagrams",
    "computes the median of a list", "groups words by their first letter", "generates all permutations of a list",
    "implements a simple LRU cache", "finds all files with a given extension in a directory",
]
CODE_LANGS = ["Python", "Python", "Python", "JavaScript", "C", "C++", "Java", "Rust", "Go", "Bash"]
CODE_T = [
    "Write a {lang} function that {task}.", "Implement a {lang} program that {task}.",
    "Develop a {lang} script that {task}.", "How do I write code in {lang} that {task}?",
    "Write a function that {task}. Use {lang}.", "Show me {lang} code that {task}, with comments.",
]
CODE_DOC_T = [
    "Explain what the following Python code does:\n\n{code}", "Is there a bug in this code?\n{code}",
    "Rewrite this code to be more readable:\n{code}", "What is the output of this code?\n{code}",
    "Add comments to the following code:\n{code}",
]
EXTRACT_T = [
    "Extract all the command names mentioned in the following text:\n{p}",
    "List the key terms defined in this passage:\n\n{p}",
    "Read the text below and return a JSON object with the fields \"topic\" and \"keywords\".\n{p}",
    "Identify the main topic and three supporting details in this text:\n{p}",
    "From the following text, extract every option or parameter it mentions, one per line.\n\n{p}",
    "Rate the clarity of the following documentation on a scale of 1 to 5 and explain why:\n{p}",
    "Create a table of the concepts in this passage and a one-line description of each:\n{p}",
    "Turn the following passage into a list of questions and answers:\n{p}",
]
REASONING_T = [
    "If you have {a} apples and you give away {b}, then buy {c} more, how many do you have? Explain your reasoning.",
    "{n1} is taller than {n2}. {n2} is taller than {n3}. Who is the shortest? Explain.",
    "A bat and a ball cost ${a}.{b:02d} in total. The bat costs ${c} more than the ball. How much does the ball cost?",
    "If it takes {a} machines {a} minutes to make {a} widgets, "
    "how long would it take {c} machines to make {c} widgets?",
    "There are {a} people in a room. Each person shakes hands with every other person once. "
    "How many handshakes are there?",
    "What comes next in the sequence {a}, {s2}, {s3}, {s4}, ...? Explain the pattern.",
    "If all {x}s are {y}s and some {y}s are {z}s, can we conclude that some {x}s are {z}s? Explain.",
    "{n1} has {a} siblings. Each sibling has {b} children. How many nieces and nephews does {n1} have?",
]
FOLLOWUPS = [
    "Now make it shorter.",
    "Can you explain that in simpler words?", "Summarize your answer in one sentence.",
    "Rewrite your answer as a poem.", "Now translate your answer into German.", "Give me three more examples.",
    "Rephrase it in a more formal tone.", "Now rewrite it for a five-year-old.",
    "What are the main weaknesses of your answer?",
    "Turn your answer into a bulleted list.", "Can you expand on the second point?",
    "Why is that true?", "Give me a title for this.",
    "Please continue.", "Now do the same for a different topic of your choice.", "Add a conclusion to your response.",
    "What would a critic say about this?",
]
NAMES = ["Jen", "Tom", "Maria", "Ahmed", "Li", "Sofia", "James", "Priya", "Carlos", "Emma", "Noah", "Olivia", "Mateo",
         "Yuki", "Fatima", "Lucas", "Chloe", "Omar", "Hannah", "Ivan", "Grace", "Kofi", "Elena", "Raj", "Mia", "Ben",
         "Janet", "Weng", "Betty", "Natalia", "Julie", "Mark", "Albert", "Tina", "Kylar", "Toulouse", "Randy", "Joy"]
ITEMS = [("apple", "apples"), ("book", "books"), ("pencil", "pencils"), ("cookie", "cookies"), ("ticket", "tickets"),
         ("shirt", "shirts"), ("egg", "eggs"), ("flower", "flowers"), ("marble", "marbles"), ("card", "cards"),
         ("cupcake", "cupcakes"), ("toy car", "toy cars"), ("notebook", "notebooks"), ("sticker", "stickers"),
         ("orange", "oranges"), ("sandwich", "sandwiches"), ("bottle of water", "bottles of water"),
         ("lemon", "lemons")]
COUNTRIES = ["France", "Japan", "Brazil", "Kenya", "Canada", "Norway", "India", "Mexico", "Egypt", "Australia", "Peru",
             "Vietnam", "Germany", "Italy", "Spain", "Chile", "Ghana", "Poland", "Turkey", "Thailand", "Argentina"]
ANIMALS = ["cat", "dog", "elephant", "dolphin", "owl", "horse", "penguin", "bee", "octopus", "giraffe", "wolf", "bat"]
PEOPLE = ["Marie Curie", "Leonardo da Vinci", "Ada Lovelace", "Isaac Newton", "Cleopatra", "Nelson Mandela",
          "Galileo Galilei", "Frida Kahlo", "Alan Turing", "Mahatma Gandhi", "Jane Austen", "Nikola Tesla",
          "Charles Darwin", "Confucius", "Amelia Earhart", "Ludwig van Beethoven", "Rosalind Franklin"]
EVENTS = ["the French Revolution", "the moon landing", "the fall of the Berlin Wall", "the first Olympic Games",
          "the invention of the printing press", "World War I", "the Renaissance", "the industrial revolution"]
THINGS = ["telephone", "printing press", "light bulb", "bicycle", "microscope", "steam engine", "radio", "computer",
          "airplane", "compass", "refrigerator", "camera", "clock", "television", "internet", "vaccine"]
THINGS2 = ["ocean", "desert", "mountain", "animal", "lake", "city", "book", "food", "planet", "movie", "sport"]


def math_problem(rng: random.Random) -> str:
    """An arithmetic word problem (GSM8K-like) with fresh names and numbers."""
    n1, n2 = rng.sample(NAMES, 2)
    item, items = rng.choice(ITEMS)
    a, b, c = rng.randint(2, 60), rng.randint(2, 30), rng.randint(2, 15)
    price, pct = rng.choice([2, 3, 4, 5, 8, 10, 12, 15, 20, 25, 40]), rng.choice([10, 20, 25, 30, 40, 50, 75])
    hours, rate = rng.randint(2, 12), rng.choice([8, 10, 12, 15, 18, 20, 25])
    t = rng.randrange(24)
    problems = [
        f"{n1} has {a} {items}. {n2} gives {n1} {b} more, and then {n1} gives away {c}. "
        f"How many {items} does {n1} have now?",
        f"{n1} buys {a} {items} at ${price} each. How much does {n1} spend in total?",
        f"A store sells {items} for ${price} each. {n1} buys {b} of them and pays with a "
        f"${price * b + rng.choice([5, 10, 20])} bill. How much change does {n1} get?",
        f"{n1} works {hours} hours a day for {c} days and earns ${rate} per hour. How much does {n1} earn?",
        f"There are {a} students in a class. {pct}% of them are girls. How many boys are there?",
        f"{n1} reads {b} pages a day. The book has {a * b} pages. How many days will it take {n1} to finish the book?",
        f"A train travels at {rate * 4} miles per hour for {hours} hours. How far does it travel?",
        f"{n1} is {a} years old. {n2} is {c} years older than twice {n1}'s age. How old is {n2}?",
        f"{n1} baked {a * 2} {items}. {n1} ate {c} and shared the rest equally among {rng.choice([2, 3, 4])} "
        f"friends. How many did each friend get? (Round down if needed.)",
        f"A rectangle is {a} cm long and {b} cm wide. What is its area and its perimeter?",
        f"{n1} saves ${price} every week. How many weeks does it take to save ${price * a}?",
        f"The price of a {item} was ${price * 10}. It is on sale for {pct}% off. What is the sale price?",
        f"{n1} runs {c} miles on Monday, twice as far on Tuesday, and {b} miles on Wednesday. "
        f"How many miles did {n1} run in total?",
        f"A farmer has {a} chickens and {b} cows. How many legs are there in total?",
        f"{n1} had ${a * 10}. {n1} spent a quarter of it on a {item} and ${b} on lunch. How much money is left?",
        f"A recipe needs {c} eggs for {b} pancakes. How many eggs are needed for {b * 3} pancakes?",
        f"{n1} and {n2} share {a * 6} {items} in the ratio 1:2. How many does each get?",
        f"A car uses {c} liters of fuel per 100 km. How much fuel does it need for {a * 10} km?",
        f"{n1} starts work at {t % 12 + 1} o'clock and works for {hours} hours. At what time does {n1} finish?",
        f"The sum of two numbers is {a + b} and their difference is {abs(a - b)}. What are the numbers?",
        f"If {c} workers can build a wall in {hours} days, how long would {c * 2} workers take?",
        f"{n1} scored {a}, {b} and {a + c} points in three games. What is the average score?",
        f"A tank holds {a * 10} liters. It is {pct}% full. How many more liters are needed to fill it?",
        f"{n1} bought {b} packs of {items} with {c} in each pack and gave {n2} {c} of them. How many are left?",
    ]
    p = rng.choice(problems)
    return rng.choice(["{p}", "{p}", "{p} Let's think step by step.", "Solve: {p}", "{p} Show your work.",
                       "Question: {p}\nAnswer:", "Solve this math problem: {p}"]).format(p=p)


class Builder:
    def __init__(self, seed: int, man_limit: int) -> None:
        self.rng = rng = random.Random(seed)
        t0 = time.time()
        self.docs = (sources.python_doc_sections() + sources.debian_reference_sections()
                     + sources.man_pages(man_limit, rng))
        self.wordnet = sources.wordnet_entries()
        self.gcide = sources.gcide_entries(30000, rng)
        self.quotes_en = sources.fortunes("en")
        self.quotes_de = sources.fortunes("de")
        nouns = [w.split(", ")[0] for pos, w, g in self.wordnet if pos == "noun" and len(w.split(", ")[0]) > 3]
        self.topics = [n for n in nouns if " " not in n or n.count(" ") == 1]
        self.sentences_en = [s for p in self._all_paras() for s in re.split(r"(?<=[.!?])\s+", p)
                             if 40 < len(s) < 300 and "\n" not in s]
        self.code_blocks = [p for _, ps in self.docs for p in ps if p.startswith(">>>") or p.startswith("def ")]
        print(f"sources: {len(self.docs)} documents, {len(self.wordnet)} synsets, {len(self.gcide)} gcide entries, "
              f"{len(self.quotes_en)}/{len(self.quotes_de)} en/de quotes, {len(self.code_blocks)} code blocks "
              f"({time.time() - t0:.1f} s)", file=sys.stderr)

    def _all_paras(self):
        for _, ps in self.docs:
            yield from (p for p in ps if "\n" not in p)

    def passage(self, lo: int, hi: int) -> tuple[str, str]:
        """(document title, consecutive paragraphs of about lo..hi characters)."""
        rng = self.rng
        while True:
            title, paras = rng.choice(self.docs)
            i = rng.randrange(len(paras))
            target = rng.randint(lo, hi)
            out, n = [], 0
            while i < len(paras) and n < target:
                out.append(paras[i])
                n += len(paras[i]) + 2
                i += 1
            if n >= lo * 0.6:
                return title, "\n\n".join(out)[: hi + 200]

    def term(self, text: str) -> str:
        cands = re.findall(r"\b[a-z_][a-z0-9_]*\(\)|\b[A-Z][a-zA-Z]{3,}(?: [A-Z][a-zA-Z]+)?\b|\b[a-z]{6,}\b", text)
        return self.rng.choice(cands) if cands else self.rng.choice(self.topics)

    def word(self) -> str:
        if self.rng.random() < 0.5:
            return self.rng.choice(self.gcide)[0].lower()
        return self.rng.choice(self.topics)

    def make(self, category: str) -> dict:
        rng = self.rng
        followups: list[str] = []
        if category == "summarization":
            _, p = self.passage(300, 6000) if rng.random() < 0.8 else ("", " ".join(rng.sample(self.quotes_en, 5)))
            content = rng.choice(SUMMARY_T).format(p=p)
        elif category == "rag":
            n = rng.randint(2, 6)
            parts = [self.passage(300, 900) for _ in range(n)]
            t = self.term(parts[rng.randrange(n)][1])
            docs = "\n".join((f"{title}\n{p}" if rng.random() < 0.5 else p) for title, p in parts)
            q = rng.choice(RAG_Q).format(t=t)
            content = rng.choice(RAG_T).format(docs=docs, q=q, ql=q[0].lower() + q[1:])
        elif category == "translation":
            if rng.random() < 0.75:
                content = rng.choice(TRANSLATE_DE_EN).format(s=rng.choice(self.quotes_de))
            else:
                s = rng.choice(self.quotes_en if rng.random() < 0.5 else self.sentences_en)
                content = rng.choice(TRANSLATE_EN_X).format(lang=rng.choice(LANGS), s=s)
        elif category == "qa":
            r = rng.random()
            if r < 0.45:
                content = rng.choice(QA_WORD).format(w=self.word(), w2=self.word())
            elif r < 0.8:
                content = rng.choice(QA_GENERAL).format(
                    thing=rng.choice(THINGS), thing2=rng.choice(THINGS2), w=self.word(), country=rng.choice(COUNTRIES),
                    unit=rng.choice(["seconds", "minutes", "days", "inches", "grams", "centimeters"]),
                    big=rng.choice(["day", "week", "year", "foot", "kilogram", "meter"]), animal=rng.choice(ANIMALS),
                    person=rng.choice(PEOPLE), event=rng.choice(EVENTS))
            else:
                head, body = rng.choice(self.gcide)
                templates = ["{b}\n\nWhat does {h} mean in plain English?", "Explain this dictionary entry: {b}",
                             "Based on this definition, write a sentence using \"{h}\": {b}"]
                content = rng.choice(templates).format(b=body, h=head)
        elif category == "math":
            content = math_problem(rng)
        elif category == "writing":
            content = rng.choice(WRITING_T).format(topic=rng.choice(self.topics), thing=rng.choice(self.topics),
                                                   quote=rng.choice(self.quotes_en))
        elif category == "explain":
            content = rng.choice(EXPLAIN_T).format(topic=self.word(), topic2=self.word(), field=rng.choice(FIELDS))
        elif category == "roleplay":
            q = rng.choice(ROLEPLAY_Q).format(topic=rng.choice(self.topics), thing2=rng.choice(THINGS2))
            content = rng.choice(ROLEPLAY_T).format(persona=rng.choice(PERSONAS), q=q, topic=rng.choice(self.topics))
        elif category == "coding":
            if rng.random() < 0.7 or not self.code_blocks:
                content = rng.choice(CODE_T).format(lang=rng.choice(CODE_LANGS), task=rng.choice(CODE_TASKS))
            else:
                content = rng.choice(CODE_DOC_T).format(code=rng.choice(self.code_blocks)[:1500])
        elif category == "extraction":
            content = rng.choice(EXTRACT_T).format(p=self.passage(300, 2500)[1])
        elif category == "reasoning":
            a, b, c = rng.randint(2, 20), rng.randint(1, 9), rng.randint(1, 9)
            seq = rng.choice([(a, a + b, a + 2 * b, a + 3 * b), (a, a * 2, a * 4, a * 8), (1, 4, 9, 16), (2, 3, 5, 7)])
            n1, n2, n3 = rng.sample(NAMES, 3)
            x, y, z = rng.sample(["cat", "animal", "pet", "bird", "flower", "plant", "car", "machine", "tool"], 3)
            content = rng.choice(REASONING_T).format(a=a, b=b, c=c, n1=n1, n2=n2, n3=n3, s2=seq[1], s3=seq[2],
                                                      s4=seq[3], x=x, y=y, z=z)
        else:
            raise ValueError(category)
        if (category in ("writing", "explain", "roleplay", "coding", "reasoning", "qa", "math")
                and rng.random() < FOLLOWUP_FRACTION):
            followups.append(rng.choice(FOLLOWUPS))
        return {"category": category, "messages": [{"role": "user", "content": content}], "followups": followups}


def tokenize(rows: list[dict], tokenizer_path: str, out: Path) -> None:
    """Render each chat with the target's template and store the token ids (.npz)."""
    # Imported here: only --tokenizer needs transformers and torch; building the text prompts does not.
    from transformers import AutoTokenizer

    from pipeline.distill.prompts import prompt_from_row, save_prompts

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    prompts = [prompt_from_row(r, tok) for r in rows]
    save_prompts(prompts, out)
    print(f"tokenized {len(prompts)} prompts: {sum(len(p.ids) for p in prompts)} prompt tokens -> {out}",
          file=sys.stderr)


def check_overlap(rows: list[dict], eval_path: str, n: int = 8) -> list[tuple]:
    """(question_id, turn, shared n-grams) for evaluation turns sharing word n-grams with the prompts."""
    def words(t: str) -> list[str]:
        return re.sub(r"\W+", " ", t.lower()).split()

    grams = set()
    for r in rows:
        for t in [m["content"] for m in r["messages"]] + r["followups"]:
            w = words(t)
            grams.update(" ".join(w[i : i + n]) for i in range(max(1, len(w) - n + 1)))
    hits = []
    for line in open(eval_path):
        q = json.loads(line)
        for ti, turn in enumerate(q["turns"]):
            w = words(turn)
            shared = sum(" ".join(w[i : i + n]) in grams for i in range(max(1, len(w) - n + 1)))
            if shared:
                hits.append((q.get("question_id"), ti, shared))
    return hits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output .jsonl.gz")
    ap.add_argument("--num", type=int, default=60000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--man-pages", type=int, default=600, help="how many man pages to render")
    ap.add_argument("--tokenizer", help="target model folder: also write token ids (--tokenized)")
    ap.add_argument("--tokenized", help="output .npz of token ids")
    ap.add_argument("--check-eval", default=str(SPEC_BENCH_DEV),
                    help="an evaluation .jsonl (Spec-Bench): fail if any turn shares an 8-gram "
                         "(default: the shipped Spec-Bench dev prompts, %(default)s)")
    args = ap.parse_args()
    b = Builder(args.seed, args.man_pages)
    cats = list(MIX)
    weights = [MIX[c] for c in cats]
    rows = [b.make(b.rng.choices(cats, weights)[0]) for _ in range(args.num)]
    if args.check_eval:
        hits = check_overlap(rows, args.check_eval)
        if hits:
            raise SystemExit(f"prompts share 8-grams with {args.check_eval}: {hits[:10]}")
        print(f"no 8-gram shared with {args.check_eval}", file=sys.stderr)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(out, "wt") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    meta = {"num": args.num, "seed": args.seed, "mix": MIX, "followup_fraction": FOLLOWUP_FRACTION,
            "packages": sources.package_versions(), "man_packages": list(sources.MAN_PACKAGES)}
    out.with_name(out.name.split(".")[0] + ".meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {len(rows)} prompts -> {out}", file=sys.stderr)
    if args.tokenizer:
        tokenize(rows, args.tokenizer, Path(args.tokenized or out.with_suffix("").with_suffix(".npz")))


if __name__ == "__main__":
    main()
