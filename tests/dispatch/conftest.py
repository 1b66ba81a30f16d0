"""The dispatch suites' fixtures, from :mod:`dispatch_helpers` (where the helpers the test
modules import live: ``from conftest import ...`` resolved to another suite's conftest when
suites were collected together)."""

from dispatch_helpers import fake, llama, refused_url, sched, tiny_gguf  # noqa: F401  (fixtures)
