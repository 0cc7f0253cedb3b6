"""The project's chat prompts, by category: drafter self-distillation, held-out acceptance, benchmarks.

Categories follow SPEED-Bench's spirit (coding, math, QA, writing, summarization, reasoning, rewrite,
extraction, translation, explanation). Each prompt is a template filled with a subject, so a few
lines give hundreds of distinct prompts; the split is fixed and deterministic::

    split("train")     -> [ChatPrompt("coding", "Write a Python function that reverses a list."), ...]
    split("heldout")   -> prompts never used for training: held-out acceptance, bench, compare --e2e

A held-out prompt differs from every training prompt in its subject (the last ``HELDOUT`` subjects of
each category), not only in its template, so acceptance measured on it is not recall.
"""

from __future__ import annotations

from dataclasses import dataclass

HELDOUT = 3  # subjects per category kept out of training


@dataclass(frozen=True)
class ChatPrompt:
    category: str
    text: str

    def messages(self, system: str | None = None) -> list[dict]:
        pre = [{"role": "system", "content": system}] if system else []
        return [*pre, {"role": "user", "content": self.text}]


# category -> (templates with one {} slot, subjects); the last HELDOUT subjects are held out
_SETS: dict[str, tuple[list[str], list[str]]] = {
    "coding": (
        ["Write a Python function that {}.", "Show a short Python example of a function that {}.",
         "Write a JavaScript function that {}."],
        ["reverses a list", "checks whether a string is a palindrome", "counts the words in a sentence",
         "returns the largest number in a list", "removes duplicates from a list", "reads a file line by line",
         "computes the factorial of n", "sorts a list of dictionaries by a key", "merges two sorted lists",
         "converts Celsius to Fahrenheit", "finds the second smallest element", "flattens a nested list",
         "checks whether a number is prime", "returns the n-th Fibonacci number", "capitalizes every word"],
    ),
    "math": (
        ["What is {}? Show your steps.", "Solve step by step: {}.", "Compute {} and explain briefly."],
        ["17 times 23", "15% of 240", "the area of a circle with radius 3", "144 divided by 12 plus 7",
         "the average of 4, 8, 15 and 23", "2 to the power of 10", "the square root of 196",
         "the perimeter of a rectangle 5 by 8", "3/4 plus 2/3", "the sum of the first 10 positive integers",
         "x if 3x + 5 = 20", "the hypotenuse of a right triangle with legs 6 and 8", "1000 minus 387",
         "the volume of a cube with side 4", "20% off a price of 80 dollars"],
    ),
    "qa": (
        ["What is {}?", "Tell me briefly about {}.", "Give three facts about {}."],
        ["the capital of France", "photosynthesis", "the Great Wall of China", "the speed of light",
         "the largest planet in the solar system", "DNA", "the Eiffel Tower", "the water cycle",
         "the Pacific Ocean", "the human heart", "gravity", "the Amazon rainforest", "the Moon",
         "volcanoes", "the Roman Empire"],
    ),
    "writing": (
        ["Write a short poem about {}.", "Write a short story about {}.", "Write a haiku about {}."],
        ["autumn leaves", "a lost cat", "the ocean at night", "a rainy morning", "friendship",
         "a robot learning to paint", "the first day of school", "a mountain village", "coffee",
         "a city at dawn", "an old lighthouse", "winter snow", "a garden in spring", "the stars",
         "a long train journey"],
    ),
    "summarization": (
        ["Summarize in one sentence: {}", "Give a short summary of this text: {}",
         "What is the main point of this passage? {}"],
        ["The meeting was moved from Monday to Wednesday because the manager was traveling. Everyone "
         "must bring their quarterly reports.",
         "Solar panels convert sunlight into electricity. They are becoming cheaper every year, and many "
         "homes now use them to lower their energy bills.",
         "The library will close early on Friday for maintenance. Books can still be returned through "
         "the drop box outside the main entrance.",
         "Regular exercise improves mood, sleep and heart health. Experts recommend at least 150 minutes "
         "of moderate activity each week.",
         "The company released a new phone with a larger battery and a better camera, but the price "
         "went up by fifty dollars.",
         "Bees pollinate many of the crops we eat. Their numbers have fallen because of pesticides, "
         "disease and loss of habitat.",
         "The city plans to add new bike lanes downtown next year to reduce traffic and make cycling "
         "safer for commuters.",
         "Drinking enough water helps the body regulate temperature, keeps joints lubricated and "
         "supports digestion.",
         "The museum opened a new exhibit about ancient Egypt, featuring mummies, jewelry and tools "
         "from over three thousand years ago.",
         "Online courses let students learn at their own pace, but some find it hard to stay motivated "
         "without a teacher nearby.",
         "The storm knocked out power to thousands of homes. Crews worked through the night and most "
         "service was restored by morning.",
         "Recycling reduces waste in landfills and saves raw materials, but only if items are sorted "
         "correctly before collection.",
         "The team won the championship after a close final game, scoring the winning goal in the last "
         "minute of extra time.",
         "A balanced diet includes fruits, vegetables, whole grains and protein. Too much sugar can lead "
         "to health problems.",
         "The new train line cuts the trip between the two cities from three hours to ninety minutes "
         "and runs every half hour."],
    ),
    "reasoning": (
        ["Answer and explain your reasoning: {}", "Think step by step: {}", "{} Explain briefly."],
        ["If all cats are animals and Tom is a cat, is Tom an animal?",
         "A bat and a ball cost 1.10 dollars and the bat costs 1 dollar more than the ball. How much is the ball?",
         "If it rains the ground gets wet. The ground is wet. Did it necessarily rain?",
         "Anna is taller than Ben and Ben is taller than Carl. Who is the shortest?",
         "What comes next in the sequence 2, 4, 8, 16?",
         "If today is Tuesday, what day will it be in 10 days?",
         "A farmer has 10 sheep and all but 3 run away. How many are left?",
         "Which is heavier, a kilogram of feathers or a kilogram of iron?",
         "If you have 3 apples and take away 2, how many apples do you have?",
         "Five machines make five widgets in five minutes. How long do 100 machines take for 100 widgets?",
         "Is the number 91 prime?", "Can a square also be a rectangle?",
         "If a train leaves at 3 pm and the trip takes 2 hours 45 minutes, when does it arrive?",
         "Mary's father has four children: North, South, East and who?",
         "Which is larger, 0.5 or 0.45?"],
    ),
    "rewrite": (
        ["Rewrite this more formally: {}", "Make this sentence clearer: {}", "Rewrite this politely: {}"],
        ["gonna grab food, brb", "the thing broke again and nobody fixed it", "send me the file asap",
         "we ain't got time for this", "your code doesnt work", "can u call me later",
         "the meeting was kinda pointless", "i need the report by tomorrow no excuses",
         "this app is super slow lol", "stop sending me emails", "the food was ok i guess",
         "why is the printer always broken", "pls fix the bug now", "u forgot to reply",
         "the movie was way too long"],
    ),
    "extraction": (
        ["Extract all names from this text: {}", "List the dates mentioned in: {}",
         "Which places are mentioned here? {}"],
        ["Alice met Bob and Carol in Paris on March 3rd.", "On June 5 John flew from London to Tokyo.",
         "Maria and Pedro opened a cafe in Madrid in 2019.", "The conference in Berlin runs from May 2 to May 4.",
         "Dr. Smith visited Cairo and Nairobi last August.", "Emma called Liam from Sydney on New Year's Day.",
         "The treaty was signed in Vienna on 12 April 1961 by several countries.",
         "Sophie and Noah moved to Toronto in September.", "Ravi met Aiko in Osaka on July 21.",
         "The festival starts in Rio on February 9 and ends in Salvador.",
         "Lucas emailed Zoe about the trip to Rome next Friday.",
         "In 1969 Neil Armstrong walked on the Moon.", "Olga drove from Kyiv to Warsaw on Monday.",
         "Chen and Priya presented in Boston on October 14.", "The ship sailed from Lisbon to Cape Town in 1497."],
    ),
    "translation": (
        ["Translate into French: {}", "Translate into Spanish: {}", "Translate into German: {}"],
        ["Good morning, how are you?", "Where is the train station?", "I would like a cup of coffee.",
         "The weather is nice today.", "Thank you very much for your help.", "What time is it?",
         "My name is Anna.", "I love reading books.", "How much does this cost?", "See you tomorrow.",
         "The cat is sleeping on the sofa.", "Please open the window.", "I am learning a new language.",
         "We are going to the beach.", "Happy birthday!"],
    ),
    "explanation": (
        ["Explain {} to a ten-year-old.", "Explain {} in simple terms.", "Why does {} matter?"],
        ["how rainbows form", "what a computer virus is", "why the sky is blue", "how vaccines work",
         "what inflation is", "how airplanes fly", "what machine learning is", "why we have seasons",
         "how the internet works", "what a black hole is", "how batteries store energy",
         "why leaves change color", "what recycling does", "how the heart pumps blood", "what an atom is"],
    ),
}

CATEGORIES = tuple(_SETS)


def split(which: str) -> list[ChatPrompt]:
    """``"train"``, ``"heldout"`` or ``"all"``: every (template, subject) pair, category by category."""
    if which not in ("train", "heldout", "all"):
        raise ValueError(f"unknown split {which!r}; accepted: 'train', 'heldout', 'all'")
    out = []
    for cat, (templates, subjects) in _SETS.items():
        cut = len(subjects) - HELDOUT
        for i, subject in enumerate(subjects):
            if which == "all" or (i < cut) == (which == "train"):
                out += [ChatPrompt(cat, t.format(subject)) for t in templates]
    return out


def heldout(per_category: int = 2) -> list[ChatPrompt]:
    """``per_category`` held-out prompts of each category, each from another subject (bench, compare)."""
    out = []
    for cat, (templates, subjects) in _SETS.items():
        held = subjects[len(subjects) - HELDOUT:]
        out += [ChatPrompt(cat, templates[i % len(templates)].format(held[i % len(held)]))
                for i in range(per_category)]
    return out


def rendered_heldout(out_dir, per_category: int = 1) -> list[tuple[str, str]] | None:
    """(category, text) of :func:`heldout` prompts rendered with the export's own chat template, ready
    to generate from (tune's calibration set, compare --e2e's default); None without a template."""
    from graphs.chat import ChatTemplate

    template = ChatTemplate.from_export(out_dir)
    if template is None:
        return None
    return [(p.category, template.render(p.messages(), add_generation_prompt=True)) for p in heldout(per_category)]

