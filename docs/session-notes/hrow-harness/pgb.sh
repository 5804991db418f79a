#!/bin/bash
# pgb.sh NAME "DDL(%s)" : per-statement server instructions of one prepared INSERT ... ON CONFLICT DO NOTHING (pgbench, one backend)
N1=1000; N2=5000
name=$1; ddl=$2; db=${3:-postgres}; cons=${4:-"'orders-service'"}
P="psql -h 127.0.0.1 -p 55433 -U postgres -d $db -Atq"
R=/tmp/hrow/pg
cat > /tmp/hrow/pg/s_$name.sql <<EOS
\set i random(1, 100000000000)
INSERT INTO t_$name (consumer, event_id, event_at) VALUES ($cons, (lpad(to_hex(1780000000000 + :i::bigint), 12, '0') || '7000800000000000' || lpad(to_hex(:i::bigint % 65536), 4, '0'))::uuid, to_timestamp((1780000000000 + :i::bigint) / 1000.0)) ON CONFLICT DO NOTHING;
EOS
tot() {
 $P -c "DROP TABLE IF EXISTS t_$name" -c "${ddl//%s/t_$name}" >/dev/null 2>&1
 before=$(ls $R/cg | sort)
 pgbench -h 127.0.0.1 -p 55433 -U postgres -n -M prepared -f /tmp/hrow/pg/s_$name.sql -t $1 $db >/dev/null 2>&1
 sleep 1
 sleep 1
 for f in $(comm -13 <(echo "$before") <(ls $R/cg | sort)); do awk '/^summary/{print $2}' $R/cg/$f; done | sort -n | tail -1
}
a=$(tot $N1); b=$(tot $N2)
echo "$db $name instr/stmt=$(( (b-a)/(N2-N1) ))"
