"""Pure rules, standard library only: the words (vocabulary, types), the book, the registry,
the keys, and the decisions (gate, capacity, deferral). Testable with no service running."""
