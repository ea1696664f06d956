"""The JSON-extraction workload of issue 36's benchmark: one schema (a person: name, age, email, city, tags) over
many short descriptions, each written from a fixed, seeded list of sentence templates and values, and the prompt
asking for the fields as JSON. `validate` checks an output against the schema (pydantic, strict types, no extra
keys): the benchmark requires every output to pass.

  .venv/bin/python -m benchmarks.structured_workload --n=48 > data/structured/extraction.jsonl
"""

from __future__ import annotations

import json
import random
import sys

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
                   "city": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
    "required": ["name", "age", "email", "city", "tags"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}

_FIRST = ["Alice", "Bruno", "Chen", "Dalia", "Emeka", "Fatima", "Goran", "Hana", "Ivan", "Jun", "Karin", "Luis",
          "Maya", "Nikolai", "Olga", "Pedro", "Quinn", "Rosa", "Sven", "Tariq", "Uma", "Viktor", "Wen", "Yusuf"]
_LAST = ["Novak", "Silva", "Tanaka", "Okafor", "Berg", "Haddad", "Kowalski", "Moreau", "Ivanova", "Rossi", "Lindqvist",
         "Mendes", "Park", "Schmidt", "Duarte", "Kim"]
_CITIES = ["Lyon", "Porto", "Osaka", "Lagos", "Bergen", "Beirut", "Krakow", "Nantes", "Kazan", "Turin", "Uppsala",
           "Recife", "Busan", "Leipzig", "Quito", "Austin"]
_TAGS = ["cycling", "chess", "jazz", "gardening", "photography", "climbing", "cooking", "astronomy", "pottery",
         "sailing", "poetry", "running", "robotics", "birdwatching", "tango", "baking"]
_DOMAINS = ["example.com", "mail.org", "post.net", "inbox.io"]
_TEMPLATES = [
    "{name} is {age} years old and lives in {city}. {first} loves {tags}. Reach {first} at {email}.",
    "Meet {name}, a {age}-year-old from {city} whose hobbies are {tags}. Email: {email}.",
    "Contact card: {name} ({email}), age {age}, based in {city}; interests include {tags}.",
    "After moving to {city}, {name} ({age}) took up {tags}. You can write to {email}.",
    "{name}, {age}, {city}. Enjoys {tags}. Mail {email} for details.",
    "Our new member {name} is {age}, lives in {city} and spends weekends on {tags} ({email}).",
]
INSTRUCTION = ("Extract the person's name, age, email, city and interests (tags) from the text below. Answer with a "
               "JSON object with the keys name, age, email, city, tags.\n\nText: ")


def _and(items: list) -> str:
  return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def people(n: int, seed: int = 0) -> list[dict]:
  """n distinct descriptions: {id, text, expected} (expected: the fields the text states)."""
  rng = random.Random(seed)
  out, seen = [], set()
  while len(out) < n:
    first, last, city = rng.choice(_FIRST), rng.choice(_LAST), rng.choice(_CITIES)
    age, tags = rng.randint(19, 78), rng.sample(_TAGS, rng.randint(1, 3))
    email = f"{first.lower()}.{last.lower()}@{rng.choice(_DOMAINS)}"
    t = rng.randrange(len(_TEMPLATES))
    text = _TEMPLATES[t].format(name=f"{first} {last}", first=first, age=age, city=city, tags=_and(tags),
                                email=email)
    if text in seen:
      continue
    seen.add(text)
    out.append({"id": f"person-{len(out)}", "text": text,
                "expected": {"name": f"{first} {last}", "age": age, "email": email, "city": city, "tags": tags}})
  return out


def prompt_of(person: dict) -> str:
  """The user turn (the chat template is applied by the caller: serve.generate's tokenizer or the server)."""
  return INSTRUCTION + person["text"]


_MODEL = []


def _model():
  if not _MODEL:
    from pydantic import BaseModel, ConfigDict, Field

    class Person(BaseModel):
      model_config = ConfigDict(extra="forbid", strict=True)
      name: str
      age: int
      email: str
      city: str
      tags: list[str] = Field(max_length=4)

    _MODEL.append(Person)
  return _MODEL[0]


def validate(text: str) -> tuple[bool, str]:
  """(valid against SCHEMA, the reason when not)."""
  try:
    _model().model_validate_json(text)
    return True, ""
  except Exception as e:  # pydantic's ValidationError, or not JSON at all
    return False, str(e).splitlines()[0][:200]


def main(argv):
  n = 48
  for a in argv[1:]:
    if a.startswith("--n="):
      n = int(a[4:])
  for p in people(n):
    sys.stdout.write(json.dumps({"id": p["id"], "category": "structured", "turns": [prompt_of(p)],
                                 "response_format": RESPONSE_FORMAT}) + "\n")


if __name__ == "__main__":
  main(sys.argv)
