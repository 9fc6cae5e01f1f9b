"""flashgen's attention plugged into other frameworks' extension points.

:mod:`flashgen.integrations.transformers`: Hugging Face transformers (``AttentionInterface``
and ``AttentionMaskInterface``).  Each module imports its framework only when imported
itself: ``import flashgen`` never needs them.
"""
