"""The memory tier (docs/tiers.md, "The memory tier"): saves commit into host memory on every
node, each node's part is copied to peer nodes over direct TCP, and uploaded to ``save_dir``
in the background; a restart resumes from the fastest verified copy (own memory, a peer's,
then save_dir).

- ``records``: what a node's memory directory holds, and each rank's record of its files;
- ``choice``: which save a resume can use, from every node's holdings;
- ``peers``: the job's nodes, their ring and connections; ``peer_server``/``peer_client``:
  the transport (a token, paths confined to the directory, CRC32C checked on arrival);
- ``tier``: the memory store; ``assembly``: the resume; ``destination``: the destination;
- ``local_copy`` and ``durable``: a ``local_dir`` behind memory (each save copied there before
  its upload; a resume whose memory is gone reads it).
"""
