"""memtrain's data pipeline: the sharded Arrow dataset format, writers and loaders.

Never imports ``trainer`` or ``ray``.
"""
