"""Text handling shared by the engine and the gateway: tokenizers, chat templates, messages.

No torch here: the gateway runs in the control-plane image, which has none.
"""
