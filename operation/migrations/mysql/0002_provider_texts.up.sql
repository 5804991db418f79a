-- The provider's texts in any character and of any length, whatever the
-- database's default character set (latin1 before MariaDB 11.6, utf8mb3
-- often): the reference as LONGTEXT (PostgreSQL's text and SQLite's TEXT
-- have no 64 KiB bound) and the error and the kind in utf8mb4. A reference
-- the column could not hold failed the success write after the provider's
-- call (1406 too long, 1366 incorrect string), and the key never settled.
ALTER TABLE {{.Table}}
    MODIFY kind      varchar(64) CHARACTER SET utf8mb4 NOT NULL,
    MODIFY reference longtext    CHARACTER SET utf8mb4,
    MODIFY error     mediumtext  CHARACTER SET utf8mb4;
