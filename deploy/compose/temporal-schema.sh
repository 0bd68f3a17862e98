#!/bin/sh
# Creates Temporal's two PostgreSQL databases and brings their schemas to the
# version this admin-tools image ships: the sequence the deprecated auto-setup
# image ran at every start, so running it again on a live database only
# applies what is new. Runs in temporalio/admin-tools (docker-compose.yml).
set -eu
: "${POSTGRES_SEEDS:?set POSTGRES_SEEDS}" "${POSTGRES_USER:?set POSTGRES_USER}"
: "${SQL_PASSWORD:?set SQL_PASSWORD}"
schemas=/etc/temporal/schema/postgresql/v12

sql_tool() {
    temporal-sql-tool --plugin postgres12 --ep "$POSTGRES_SEEDS" -p "${DB_PORT:-5432}" \
        -u "$POSTGRES_USER" "$@"
}

for pair in temporal:temporal temporal_visibility:visibility; do
    db=${pair%%:*}
    dir=${pair#*:}
    echo "schema: $db"
    sql_tool --db "$db" create
    sql_tool --db "$db" setup-schema -v 0.0
    sql_tool --db "$db" update-schema -d "$schemas/$dir/versioned"
done
echo "schema: up to date"
