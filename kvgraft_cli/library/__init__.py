"""The library of verified solutions at work: finding what the store holds for a problem (exact hit or related
solutions by full-text retrieval), chaining several solutions into one exact context, and ``kvgraft solve``, which
answers problems from them and grows the library with every verified answer."""
