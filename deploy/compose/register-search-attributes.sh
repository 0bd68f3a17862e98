#!/bin/sh
# Creates the namespace and registers the search attributes proxy-operator's
# workflows upsert, before any worker starts. Arguments: NAME=Type pairs
# (Keyword, KeywordList, ...). Idempotent: what exists is left alone, so a
# second `docker compose up` succeeds too. Needs only the `temporal` CLI
# (temporalio/admin-tools in docker-compose.yml; tests run it against the dev
# server). Honours TEMPORAL_ADDRESS and TEMPORAL_NAMESPACE like the CLI does.
set -eu
namespace=${TEMPORAL_NAMESPACE:-default}
attempts=${SETUP_ATTEMPTS:-60}
[ "$#" -gt 0 ] || { echo "usage: $0 NAME=Type..." >&2; exit 2; }
for pair in "$@"; do
    case $pair in
        [A-Za-z]*=[A-Za-z]*) ;;
        *) echo "not NAME=Type: '$pair'" >&2; exit 2 ;;
    esac
done

# Runs "$@" (after a description) until it succeeds, $attempts tries 2 s apart.
retry() {
    what=$1
    shift
    attempt=1
    until "$@"; do
        if [ "$attempt" -ge "$attempts" ]; then
            echo "gave up after $attempts tries: $what" >&2
            exit 1
        fi
        attempt=$((attempt + 1))
        sleep 2
    done
}

healthy() { temporal operator cluster health >/dev/null 2>&1; }
# Sets $existing: the attribute table (NAME TYPE per line), or the error.
list_attributes() { existing=$(temporal operator search-attribute list --namespace "$namespace" 2>&1); }

# The frontend answers its port before it serves; wait until it is healthy.
retry "Temporal at ${TEMPORAL_ADDRESS:-localhost:7233} is healthy" healthy

if temporal operator namespace describe --namespace "$namespace" >/dev/null 2>&1; then
    echo "namespace $namespace: exists"
else
    temporal operator namespace create --namespace "$namespace"
    echo "namespace $namespace: created"
fi

# Listing fails until the new namespace has reached every frontend's cache.
retry "list the search attributes of $namespace" list_attributes

for pair in "$@"; do
    name=${pair%%=*}
    type=${pair#*=}
    listed=$(printf '%s\n' "$existing" | awk -v n="$name" '$1 == n { print $2 }')
    if [ "$listed" = "$type" ]; then
        echo "search attribute $name: exists"
    elif [ -n "$listed" ]; then
        echo "search attribute $name is registered as $listed in $namespace; workflows need $type" >&2
        exit 1
    else
        temporal operator search-attribute create --namespace "$namespace" \
            --name "$name" --type "$type"
        echo "search attribute $name: registered as $type"
    fi
done
