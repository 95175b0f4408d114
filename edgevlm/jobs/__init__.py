"""What a long run over many items needs, whoever runs it (captioning, batch files, their Ray
versions): the record log that makes it resumable (``records``) and the token that stops it
cleanly (``stop``). Below caption, hub and serve, which do not import each other."""
