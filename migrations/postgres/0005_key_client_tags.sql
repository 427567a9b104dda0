-- Which tags a key's clients may add with x-gateway-tags (JSON array of tag names); NULL: any tag
-- the key does not fix itself. The key's own tags always win.
ALTER TABLE api_keys ADD COLUMN client_tags TEXT;
