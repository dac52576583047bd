"""Model-quality evaluation run on pagedserve's own model code (`pagedserve eval ...`)."""
