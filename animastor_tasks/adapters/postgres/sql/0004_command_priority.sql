-- A command's priority: free GPU slots go to the highest priority waiting first
-- (interactive, normal, bulk; see domain/vocabulary.py Priority).
ALTER TABLE commands ADD COLUMN priority text NOT NULL DEFAULT 'normal';
