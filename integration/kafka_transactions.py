"""Produces to a Kafka-protocol broker with confluent-kafka, for the transaction tests.

    kafka_transactions.py BROKER TOPIC plain FIRST COUNT      plain records {"id": n}
    kafka_transactions.py BROKER TOPIC open TXN_ID FIRST COUNT records in a transaction left open
    kafka_transactions.py BROKER TOPIC fence TXN_ID           abort TXN_ID's open transaction

tansu 0.6 has no EndTxn, so a transaction cannot be committed or aborted by its producer; a
second producer initialising the same transactional.id fences the first and aborts its open
transaction, which writes ABORT markers into the log — the way a real deployment's restarted
producer does.
"""
import sys

from confluent_kafka import Producer

broker, topic, action = sys.argv[1], sys.argv[2], sys.argv[3]
conf = {"bootstrap.servers": broker}


def produce(producer, first, count):
    for n in range(first, first + count):
        producer.produce(topic, value=('{"id": %d}' % n).encode(), partition=0)
    producer.flush(30)


if action == "plain":
    produce(Producer(conf), int(sys.argv[4]), int(sys.argv[5]))
elif action == "open":
    producer = Producer({**conf, "transactional.id": sys.argv[4], "transaction.timeout.ms": 600000})
    producer.init_transactions(30)
    producer.begin_transaction()
    produce(producer, int(sys.argv[5]), int(sys.argv[6]))
elif action == "fence":
    Producer({**conf, "transactional.id": sys.argv[4]}).init_transactions(30)
else:
    sys.exit(f"unknown action {action}")
