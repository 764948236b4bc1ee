"""Writes data.jsonl, the qlora example's tiny instruction set: three small tasks a model can only
answer by reading the prompt (reverse a word, add two numbers, shout a phrase), half the lines in
alpaca format and half in chat-messages format. Usage: python3 make_data.py"""
import json, os, random

WORDS = ["kiln", "clay", "glaze", "fire", "brick", "heat", "pot", "ash", "wheel", "slip", "kiln wash", "cone"]
rng = random.Random(7)
lines = []
for i in range(96):
    task = i % 3
    if task == 0:
        word = rng.choice(WORDS)
        instruction, answer = f"Reverse the letters of: {word}", word[::-1]
    elif task == 1:
        a, b = rng.randrange(10, 50), rng.randrange(1, 50)
        instruction, answer = f"What is {a} plus {b}?", str(a + b)
    else:
        phrase = " ".join(rng.sample(WORDS, 2))
        instruction, answer = f"Shout: {phrase}", phrase.upper() + "!"
    if i % 2 == 0:
        lines.append({"instruction": instruction, "input": "", "output": answer})
    else:
        lines.append({"messages": [{"role": "user", "content": instruction}, {"role": "assistant", "content": answer}]})
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "data.jsonl"), "w") as f:
    for line in lines:
        f.write(json.dumps(line) + "\n")
print(len(lines), "examples")
