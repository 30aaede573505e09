"""Applications built on Tessera, using the library as a user would (a lower floor never
imports these)."""
