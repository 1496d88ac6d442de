"""Euterpe: the transcoding service on the inbox/outbox protocol (euterpe-contract.md).

Requesters enqueue transcode jobs (``inbox_jobs``) over HTTP; workers lease
them with the ownership protocol of :mod:`trace_core.leasing` and drive the
stage machine; every transition writes its history row and its webhook event
(``job_outbox_events``) in the same transaction; deliverers lease those
events and post them, signed, to the requester's webhook.
"""
