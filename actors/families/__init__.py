"""Model families: the tool-call and reasoning markup each writes, and the template
variables each reads, picked for a model from its chat template or vocabulary."""
