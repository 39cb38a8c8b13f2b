"""What a server runs with: the model's config (``model``), the server arguments (``server_args``) and the
pool sizes every process derives alike from both (``pools``)."""
