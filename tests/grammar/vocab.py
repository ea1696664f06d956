"""A byte vocabulary for the tiny random models (97 ids): 0-2 specials (pad, EOS, BOS), then JSON's characters
and a few multi-character tokens, so a grammar over it has several tokenizations and forced stretches."""

import string

SINGLE = list('{}[]":,. -') + list(string.digits) + list(string.ascii_lowercase)
MULTI = ['"name"', '": "', '", "', '"age"', '{"', '"}', '": ', 'true', 'false', 'null', 'ab', 'ba', 'na',
         'me', '12', '"a', 'yes', 'no', 'maybe', 'red', 'green', 'blue', '"tags"', '["', '"]', '", ', 'ok', 'an',
         'en', 'er', 're', 'on', 'in', 'at', 'es', 'ed', 'or', 'is', 'it', 'al', 'ar', 'st', 'to', 'nt', 'ng', 'se',
         'ha', 'ge']


def token_bytes(vocab_size: int = 97) -> list:
  pieces = [None, None, None] + [p.encode() for p in SINGLE + MULTI]
  assert len(pieces) >= vocab_size, len(pieces)
  return pieces[:vocab_size]
