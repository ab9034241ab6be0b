"""The input-grounded workload of the speculative-decoding benchmark: "rewrite this passage
with one change". Most of a faithful answer copies the input, which is the work prompt
lookup speeds up (as editing, summarising, RAG and code changes do). Each passage is
roughly 300 tokens with the instruction, in the SmolLM2 tokenizer.
"""

from __future__ import annotations

from servefleet.bench.workloads import Prompt

PASSAGES: tuple[tuple[str, str, str], ...] = (
    (
        "lighthouse",
        "tower",
        "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every "
        "night its keeper climbed the narrow stairs, trimmed the wick and watched the ships pass "
        "safely through the rocky strait below. When the winter storms came, the waves broke "
        "against the rocks with a sound like distant thunder, and spray reached the lamp room "
        "itself, but the light never failed. The keeper kept a logbook in which he wrote the "
        "name of every ship he saw, the direction of the wind and the height of the sea. Over "
        "the years the logbook grew into a shelf of logbooks, and the shelf into a small "
        "library that filled the room at the bottom of the lighthouse. Sailors who came ashore "
        "in the village would sometimes walk up the path to thank him, and he would show them "
        "the page on which their ship was written down. When the lighthouse was finally "
        "replaced by an automatic beacon, the logbooks were taken to the museum in the town, "
        "where they can still be read today. Visitors are often surprised by how calm the "
        "handwriting stays, even on the nights of the worst storms, as if the keeper had known "
        "all along that the light would hold.",
    ),
    (
        "river",
        "canal",
        "The river runs through the middle of the city, and most of the city's history has "
        "happened on its banks. The first settlers built their houses close to the water, "
        "where they could fish, wash and trade with the boats that came up from the coast. "
        "Later the merchants built warehouses along the river, and the warehouses were joined "
        "by mills whose wheels were turned by the current. In the nineteenth century the river "
        "became so crowded with barges that a person could almost walk from one bank to the "
        "other without getting wet. The water was dirty then, and the smell in summer was so "
        "strong that the city council met in a building far from the river. It took fifty "
        "years and a great deal of money to clean the river again. Today the warehouses have "
        "become apartments and offices, the mills are museums, and the river is clean enough "
        "for swimming races every summer. On warm evenings people sit on the steps that lead "
        "down to the water, eating, talking and watching the light change on the surface of "
        "the river, and few of them remember how different it once was.",
    ),
    (
        "garden",
        "orchard",
        "My grandmother's garden was the largest I have ever seen behind an ordinary house. "
        "It began at the kitchen door with a row of herbs, mint, thyme, parsley and sage, "
        "which she picked every morning for the day's cooking. Beyond the herbs were the "
        "vegetable beds, laid out in straight lines with string and wooden pegs, where she "
        "grew beans, carrots, onions and more potatoes than the family could ever eat. At the "
        "far end of the garden stood six apple trees and a single pear tree, older than the "
        "house itself, which gave so much fruit in autumn that the neighbours were always "
        "invited to take what they wanted. My grandmother worked in the garden every day of "
        "the year, even in winter, when there was little to do but sweep the paths and plan "
        "for the spring. She said that the garden taught her patience, because nothing in it "
        "could be hurried, and generosity, because it always gave more than she could use. "
        "When she grew too old to dig, she sat on a bench beside the herbs and told us what to "
        "do, and the garden went on growing as if she were still doing the work herself.",
    ),
    (
        "library",
        "archive",
        "The library of the small mountain town was open only three afternoons a week, but it "
        "was the busiest building for miles around. It occupied two rooms above the post "
        "office, and its collection had been built up over many years from gifts, auctions and "
        "the occasional grant from the regional government. The librarian knew every reader "
        "by name and most of them by their taste in books, so that she could put a new novel "
        "aside for one person and a book about birds for another before they had even asked. "
        "Children came after school to do their homework at the long table by the window, and "
        "old people came to read the newspapers, which arrived a day late from the city. In "
        "winter, when the roads were closed by snow, the library was one of the few places "
        "where people could meet, and the librarian would stay open later than the rules "
        "allowed. When the town finally built a modern library with computers and a reading "
        "garden, many people said they missed the two crowded rooms above the post office, "
        "where everyone had known everyone else and the books smelled of wood smoke.",
    ),
)


def rewrite_prompts(count: int) -> list[Prompt]:
    """`count` chat prompts, cycling through the passages (token counts are estimates: the
    engine's `usage` reports the exact ones)."""
    prompts = []
    for i in range(count):
        old, new, passage = PASSAGES[i % len(PASSAGES)]
        text = (
            f"Rewrite the following passage, replacing the word '{old}' with '{new}'. Change "
            f"nothing else.\n\n{passage}"
        )
        prompts.append(Prompt(text=text, num_tokens=len(text.split()) * 4 // 3))
    return prompts
