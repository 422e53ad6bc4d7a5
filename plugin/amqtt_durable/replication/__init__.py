"""Primary-backup replication of the durable store (docs/replication.md).

The unit of replication is the group commit: the exact list of LevelDB operations one
commit writes, numbered and shipped in commit order (XAP's replication of operations,
GemFire's redundant queues). Modules, in data-flow order:

- ``framing``: the wire format of a batch and of the channel's messages (version 1).
- ``log``: the primary's bounded in-memory log of recent batches, and catch-up planning.
- ``primary`` / ``backup``: the two ends of the TCP channel (ship, apply, ack, snapshot).
- ``coordinator`` / ``etcd``: who is primary is a lease in etcd (Patroni's dcs model).
- ``ha``: one step of the HA loop: read the cluster state, decide, act, say why.
- ``commits``: the group commit's step on a primary (number, write, ship; sync acknowledgement).
- ``node``: which end runs, switched by the HA loop or ``promote``; tools' STATUS and PROMOTE.
- ``tool``: what ``amqtt-durable promote`` and ``inspect --replication`` ask a node.
- ``config``: the ``replication:`` settings.

The broker side (load on promotion, CONNACK 3 on a backup, halt on demotion) is in
amqtt_glue.DurableSessionsPlugin.
"""
